/* cachemgr.fs._unlink: the per-file checks and unlinks of cachemgr.fs.deletion, for a batch of
 * names at once, on a few threads, without the GIL.
 *
 * Why C: unlinking is the kernel's work, but one unlink at a time leaves that work serialised
 * on waits (the journal, the inode's eviction after the dir entry is gone): on the development
 * VM a few threads unlinking in one dir ran 1.5-10x one thread, and `rm -rf` is one thread.
 * Done in Python, every file would also take the GIL three times (stat, stat, unlink), which
 * the daemon's HTTP thread then waits for.
 *
 * Each name gets exactly the checks deletion.py's Python path gives it, in the same order:
 *   1. fstatat(dir_fd, name, AT_SYMLINK_NOFOLLOW): a regular file (never a link's target),
 *      not modified within min_age (a future mtime counts as young);
 *   2. fstatat(parent_fd, leaf, AT_SYMLINK_NOFOLLOW) is still the dir behind dir_fd (dev,
 *      inode): a dir moved away (out of the root, say) stops every thread before its next
 *      unlink, so at most one unlink per thread lands after such a move;
 *   3. unlinkat(dir_fd, name, 0): relative to the O_NOFOLLOW descriptor, never a path.
 * Names are checked for shape (page/temp, no '/') by the caller before they get here; the
 * '/' check is repeated here since a name with one would leave dir_fd. A dry run does 1, asks
 * for each file what the kernel would refuse its unlink for (dry_refusal), then asks once
 * whether the dir allows unlinks (faccessat).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helper_nice.h"

#define MAX_THREADS 16

/* One name's outcome; mirrored as cachemgr.fs.deletion's Outcome. */
enum status {
    DELETED, VANISHED, YOUNG, NOT_REGULAR, STAT_ERROR, UNLINK_ERROR, NOT_REACHED,
    LINKED /* deleted, but another hard link keeps the data: no block nor inode freed */
};

typedef struct {
    int dir_fd, parent_fd, dry_run, nice;
    const char *leaf;
    dev_t dev;
    ino_t ino;
    double min_age, now;
    const char **names;
    Py_ssize_t n;
    int *status;
    long long *value; /* DELETED: size; STAT_ERROR, UNLINK_ERROR: errno */
    atomic_size_t next;
    atomic_int stop; /* set once: the dir moved, or an unlink failed */
    atomic_int moved;
} Batch;

static int still_here(const Batch *b) {
    struct stat st;
    if (b->parent_fd < 0) /* the caller has no parent to check (cachemgr's own temp dirs) */
        return 1;
    if (fstatat(b->parent_fd, b->leaf, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return 0;
    return st.st_dev == b->dev && st.st_ino == b->ino;
}

/* Whether this process has CAP_FOWNER, which lets it unlink another owner's file in a sticky
 * dir. Asked each time, not once: a process that drops from root to a user (setuid after a
 * fork) loses it, and root's answer kept would count files its real run is refused. */
static int may_fowner(void) {
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    if (syscall(SYS_capget, &head, data) == 0)
        return (data[CAP_FOWNER / 32].effective >> (CAP_FOWNER % 32)) & 1;
    return geteuid() == 0;
}

/* Whether `id` (as stat shows it) is one this process's user namespace maps (`map`:
 * /proc/self/uid_map or gid_map): an unmapped owner shows as the overflow id, outside every
 * range. No map to read: the initial namespace, which maps all. */
static int id_mapped(const char *map, unsigned long id) {
    FILE *f = fopen(map, "re");
    if (f == NULL)
        return 1;
    unsigned long inside, outside, count;
    int mapped = 0;
    while (!mapped && fscanf(f, "%lu %lu %lu", &inside, &outside, &count) == 3)
        mapped = id >= inside && id - inside < count;
    fclose(f);
    return mapped;
}

/* The id stat shows for one the user namespace does not map: the kernel's default overflow
 * id (/proc/sys/kernel/overflowuid and overflowgid; a system that sets others is not told
 * apart). Only a file showing it costs the maps' reads. */
#define OVERFLOW_ID 65534

/* CAP_FOWNER over this file: the capability counts, in a user namespace (a rootless
 * container), only for a file whose uid and gid it maps (the kernel's
 * capable_wrt_inode_uidgid). */
static int fowner_of(const struct stat *st) {
    return may_fowner() &&
           (st->st_uid != OVERFLOW_ID || id_mapped("/proc/self/uid_map", st->st_uid)) &&
           (st->st_gid != OVERFLOW_ID || id_mapped("/proc/self/gid_map", st->st_gid));
}

/* What the kernel would refuse the unlink of `name` (`st`) in dir_fd for, file by file, as a
 * dry run must say without unlinking (the dir's own write permission is asked once, with
 * faccessat): EPERM for an immutable or append-only file, an append-only dir, or another
 * owner's file in a sticky dir this process does not own, without CAP_FOWNER over it (the
 * kernel's check_sticky); 0 for none. */
static int dry_refusal(int dir_fd, const char *name, const struct stat *st) {
    struct statx stx;
    unsigned long long pinned = STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND;
    if (statx(dir_fd, name, AT_SYMLINK_NOFOLLOW, 0, &stx) == 0 &&
        (stx.stx_attributes & stx.stx_attributes_mask & pinned))
        return EPERM;
    /* An append-only dir takes new names and gives none up: faccessat finds it writable. */
    if (statx(dir_fd, "", AT_EMPTY_PATH, 0, &stx) == 0 &&
        (stx.stx_attributes & stx.stx_attributes_mask & STATX_ATTR_APPEND))
        return EPERM;
    struct stat dir;
    uid_t me = geteuid();
    if (st->st_uid != me && fstat(dir_fd, &dir) == 0 && (dir.st_mode & S_ISVTX) &&
        dir.st_uid != me && !fowner_of(st))
        return EPERM;
    return 0;
}

/* Steps 1-3 for `name` in dir_fd, step 2 being here(ctx): the status (NOT_REACHED: the dir
 * moved, nothing unlinked), with *value the size (DELETED, LINKED) or an errno (the errors). */
static int check_one(int dir_fd, const char *name, double min_age, double now, int dry_run,
                     int (*here)(const void *), const void *ctx, long long *value) {
    struct stat st;
    /* NULL: the name held a NUL (see unlink_batch); a '/' would leave dir_fd. The caller's
     * shape check refuses both first. */
    if (name == NULL || strchr(name, '/') != NULL)
        return *value = EINVAL, STAT_ERROR;
    if (fstatat(dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return *value = errno, errno == ENOENT ? VANISHED : STAT_ERROR;
    if (!S_ISREG(st.st_mode))
        return NOT_REGULAR;
    double mtime = (double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec * 1e-9;
    if (min_age > 0 && now - mtime < min_age)
        return YOUNG;
    if (dry_run) {
        int refused = dry_refusal(dir_fd, name, &st);
        if (refused != 0)
            return *value = refused, UNLINK_ERROR;
    } else {
        if (!here(ctx))
            return NOT_REACHED;
        if (unlinkat(dir_fd, name, 0) != 0)
            return *value = errno, errno == ENOENT ? VANISHED : UNLINK_ERROR;
    }
    /* Another name for the same inode (an operator's `cp -al` backup on this filesystem)
     * keeps its blocks and the inode itself: the unlink removed the page, and freed nothing. */
    *value = (long long)st.st_size;
    return st.st_nlink > 1 ? LINKED : DELETED;
}

static int batch_here(const void *b) { return still_here(b); }

/* Whether an unlink error ends the batch: EACCES and EPERM (a dir we may not write in, an
 * immutable file, another owner's file in a sticky dir) keep that file only, and the caller
 * reports each one; any other error stops. */
static int stops(int status, long long value) {
    return status == NOT_REACHED ||
           (status == UNLINK_ERROR && value != EACCES && value != EPERM);
}

/* Name i of the batch; an unlink error (see stops) or a moved dir stops the batch. */
static void one(Batch *b, size_t i) {
    int status = check_one(b->dir_fd, b->names[i], b->min_age, b->now, b->dry_run, batch_here, b,
                           &b->value[i]);
    if (status == NOT_REACHED)
        atomic_store(&b->moved, 1);
    if (stops(status, b->value[i]))
        atomic_store(&b->stop, 1);
    b->status[i] = status;
}

static void *worker(void *arg) {
    Batch *b = arg;
    helper_nice(b->nice);
    for (;;) {
        if (atomic_load(&b->stop))
            break;
        size_t i = atomic_fetch_add(&b->next, 1);
        if (i >= (size_t)b->n)
            break;
        one(b, i);
    }
    return NULL;
}

/* Threads for one batch's workers, which need little stack: with glibc's default (8 MiB,
 * the rlimit) 8 threads' stacks outgrow its cache of freed stacks (40 MiB), so every batch
 * mapped and unmapped them again, on the caller's thread. */
#define WORKER_STACK (256 * 1024)

/* Start up to `threads` threads running fn(arg); how many started. */
static int start_threads(pthread_t *tids, int threads, void *(*fn)(void *), void *arg) {
    pthread_attr_t attr;
    int small = pthread_attr_init(&attr) == 0;
    if (small && pthread_attr_setstacksize(&attr, WORKER_STACK) != 0) {
        pthread_attr_destroy(&attr);
        small = 0;
    }
    int started = 0;
    while (started < threads &&
           pthread_create(&tids[started], small ? &attr : NULL, fn, arg) == 0)
        started++;
    if (small)
        pthread_attr_destroy(&attr);
    return started;
}

/* Run the batch on `threads` new threads, `nice` nicer (the caller's own priority stays), or on
 * this one if none can be started. */
static void run(Batch *b, int threads) {
    pthread_t tids[MAX_THREADS];
    int started = start_threads(tids, threads, worker, b);
    if (started == 0) {
        b->nice = 0;
        worker(b);
    }
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
}

PyDoc_STRVAR(unlink_batch_doc,
    "unlink_batch(dir_fd, parent_fd, leaf, dev, ino, names, min_age, now, threads, nice,\n"
    "             dry_run)\n"
    "-> (list of (status, value) per name, moved: bool)\n\n"
    "Check and unlink `names` relative to dir_fd, whose entry `leaf` in parent_fd must stay\n"
    "the dir (dev, ino); parent_fd -1: no such check. Status: 0 deleted (value: size),\n"
    "1 vanished, 2 young, 3 not a regular file, 4 stat error (errno), 5 unlink error (errno;\n"
    "stops the batch), 6 not reached (the batch stopped first), 7 deleted but another hard\n"
    "link keeps its data (value: size; nothing freed). `moved`: the dir left its\n"
    "parent's entry. The work runs on `threads` threads, `nice` nicer than the caller.\n"
    "Names must be UTF-8 (the caller's shape check admits ASCII only).");

/* Whether both entry points may run `threads` threads; else a ValueError is set. */
static int threads_ok(int threads) {
    if (threads >= 1 && threads <= MAX_THREADS)
        return 1;
    PyErr_SetString(PyExc_ValueError, "threads must be 1..16");
    return 0;
}

static PyObject *unlink_batch(PyObject *Py_UNUSED(self), PyObject *args) {
    Batch b;
    PyObject *seq_arg;
    unsigned long long dev, ino;
    int threads;
    memset(&b, 0, sizeof b);
    if (!PyArg_ParseTuple(args, "iisKKOddiip", &b.dir_fd, &b.parent_fd, &b.leaf, &dev, &ino,
                          &seq_arg, &b.min_age, &b.now, &threads, &b.nice, &b.dry_run))
        return NULL;
    b.dev = (dev_t)dev, b.ino = (ino_t)ino;
    if (!threads_ok(threads))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_arg, "names must be a sequence");
    if (seq == NULL)
        return NULL;
    b.n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    b.names = PyMem_Calloc((size_t)b.n + 1, sizeof *b.names);
    b.status = PyMem_Calloc((size_t)b.n + 1, sizeof *b.status);
    b.value = PyMem_Calloc((size_t)b.n + 1, sizeof *b.value);
    if (b.names == NULL || b.status == NULL || b.value == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        /* valid while `seq` holds the str: until the end of this call */
        Py_ssize_t len;
        const char *name = PyUnicode_AsUTF8AndSize(PySequence_Fast_GET_ITEM(seq, i), &len);
        if (name == NULL)
            goto done;
        /* a NUL inside would make the kernel see a shorter name: another file */
        b.names[i] = (Py_ssize_t)strlen(name) == len ? name : NULL;
        b.status[i] = NOT_REACHED;
    }
    if (threads > b.n)
        threads = b.n > 0 ? (int)b.n : 1;
    Py_BEGIN_ALLOW_THREADS
    run(&b, threads);
    Py_END_ALLOW_THREADS
    /* A dry run unlinks nothing, so it asks the kernel whether the dir allows unlinks (write
     * and search for our effective ids, not immutable), as unlink_tree does: each file the
     * real run would be refused is refused with the errno its unlink would get, so the dry
     * run counts no file the real run keeps (a cap it cannot hold reads as one). Any other
     * "no" (a read-only mount) is the real run's error to report. */
    if (b.dry_run && faccessat(b.dir_fd, ".", W_OK | X_OK, AT_EACCESS) != 0 &&
        (errno == EACCES || errno == EPERM)) {
        int denied = errno;
        for (Py_ssize_t i = 0; i < b.n; i++)
            if (b.status[i] == DELETED)
                b.status[i] = UNLINK_ERROR, b.value[i] = denied;
    }
    PyObject *list = PyList_New(b.n);
    if (list == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.n; i++) {
        PyObject *item = Py_BuildValue("(iL)", b.status[i], b.value[i]);
        if (item == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, item);
    }
    out = Py_BuildValue("(NO)", list, atomic_load(&b.moved) ? Py_True : Py_False);
done:
    PyMem_Free(b.names);
    PyMem_Free(b.status);
    PyMem_Free(b.value);
    Py_DECREF(seq);
    return out;
}

/* unlink_tree: the same checks and unlinks for the files of many dirs below one top dir (a
 * nested format's namespace dir: vLLM's hashed dirs hold a block or two each, so a C call, a
 * thread start and a walk from the root per dir cost more than the unlinks). Each dir's path
 * below the top is opened a component at a time from its parent's descriptor with
 * O_NOFOLLOW|O_DIRECTORY, and never entered if it is on another mount than the top (a
 * filesystem or bind mount put there); consecutive dirs share the opens of their common
 * components. Step 2 then checks, before each unlink, that every component is still the dir
 * it opened in its parent's entry, and the top in its own parent. A dir that cannot be opened
 * is reported and skipped; an unlink error stops its dir only; a moved dir stops everything. */

#define MAX_DEPTH 8

/* Why a dir's files were not reached: DIR_OK, or the errno of its open, or DIR_MOUNT. */
enum { DIR_OK = 0, DIR_MOUNT = -1 };

typedef struct {
    int top_fd, parent_fd, dry_run, nice;
    const char *leaf;
    dev_t dev;
    ino_t ino;
    unsigned long long mnt;
    double min_age, now;
    Py_ssize_t ndirs;
    const char **dirs;
    Py_ssize_t *first; /* dir d's names are names[first[d] .. first[d + 1]) */
    const char **names;
    int *dir_status;   /* DIR_OK, an errno, DIR_MOUNT */
    int *status;
    long long *value;
    atomic_size_t next; /* the next run of dirs to take */
    atomic_int stop;
    atomic_int moved;
} Tree;

#define RUN 64 /* dirs a thread takes at once: neighbours share their upper dirs' opens */

/* The open components of one thread's current dir. */
typedef struct {
    int depth;
    int fd[MAX_DEPTH];
    const char *name[MAX_DEPTH]; /* into the dir's path: valid while the path is */
    size_t len[MAX_DEPTH];
    dev_t dev[MAX_DEPTH];
    ino_t ino[MAX_DEPTH];
} Chain;

static void chain_cut(Chain *c, int depth) {
    while (c->depth > depth)
        close(c->fd[--c->depth]);
}

static unsigned long long mnt_of(int fd) {
    struct statx stx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID, &stx) != 0 || !(stx.stx_mask & STATX_MNT_ID))
        return 0;
    return stx.stx_mnt_id;
}

/* Open `path` (components below the top) into `c`, keeping the components it shares with
 * the dir open before; DIR_OK if we may unlink in it, or why not. */
static int chain_open(Chain *c, const Tree *t, const char *path) {
    int k = 0;
    const char *p = path;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (k == MAX_DEPTH || len == 0 || len > 255)
            return chain_cut(c, k), ENAMETOOLONG;
        if (!(k < c->depth && c->len[k] == len && !memcmp(c->name[k], p, len))) {
            chain_cut(c, k);
            char comp[256];
            memcpy(comp, p, len);
            comp[len] = '\0';
            int parent = k ? c->fd[k - 1] : t->top_fd;
            int fd = openat(parent, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd < 0)
                return errno;
            /* A dir removed since it was opened (another drain of the same trash entry took
             * it: on a FUSE mount its fd then answers ENOENT) is gone, not on another mount. */
            struct stat st;
            int gone = fstat(fd, &st) != 0;
            if (gone || mnt_of(fd) != t->mnt) {
                int e = gone || fstat(fd, &st) != 0 ? errno : 0;
                close(fd);
                return e == ENOENT || e == ESTALE ? ENOENT : DIR_MOUNT;
            }
            c->fd[k] = fd, c->name[k] = p, c->len[k] = len;
            c->dev[k] = st.st_dev, c->ino[k] = st.st_ino;
            c->depth = k + 1;
        }
        k++;
        p = end ? end + 1 : p + len;
    }
    chain_cut(c, k);
    if (k == 0)
        return ENOENT;
    /* unlinks in it allowed (write and search for our effective ids, not immutable, not a
     * read-only mount): asked in a dry run too, so that it counts no file the real run is
     * refused; any other "no" reads as EACCES (what a refused unlink reports), but a dir
     * removed meanwhile, as above: its files went with it, not a refusal. */
    if (faccessat(c->fd[k - 1], ".", W_OK | X_OK, AT_EACCESS) == 0)
        return DIR_OK;
    return errno == ENOENT || errno == ESTALE ? ENOENT : EACCES;
}

/* Whether the top is still in its parent and every component of `c` in its own. */
static int chain_here(const Chain *c, const Tree *t) {
    struct stat st;
    if (fstatat(t->parent_fd, t->leaf, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_dev != t->dev ||
        st.st_ino != t->ino)
        return 0;
    for (int k = 0; k < c->depth; k++) {
        char comp[256];
        memcpy(comp, c->name[k], c->len[k]);
        comp[c->len[k]] = '\0';
        if (fstatat(k ? c->fd[k - 1] : t->top_fd, comp, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            st.st_dev != c->dev[k] || st.st_ino != c->ino[k])
            return 0;
    }
    return 1;
}

typedef struct {
    const Chain *chain;
    const Tree *tree;
} Place;

static int chain_here_of(const void *p) {
    const Place *at = p;
    return chain_here(at->chain, at->tree);
}

/* Steps 1-3 for the names of dir d, opened in `c`: an unlink error (see stops) stops the dir,
 * a moved dir all. */
static void tree_dir(Tree *t, Chain *c, Py_ssize_t d) {
    Place at = {c, t};
    for (Py_ssize_t i = t->first[d]; i < t->first[d + 1] && !atomic_load(&t->stop); i++) {
        int status = check_one(c->fd[c->depth - 1], t->names[i], t->min_age, t->now, t->dry_run,
                               chain_here_of, &at, &t->value[i]);
        if (status == NOT_REACHED) {
            atomic_store(&t->moved, 1);
            atomic_store(&t->stop, 1);
        }
        t->status[i] = status;
        if (stops(status, t->value[i]))
            return;
    }
}

static void *tree_worker(void *arg) {
    Tree *t = arg;
    helper_nice(t->nice);
    Chain c = {0};
    while (!atomic_load(&t->stop)) {
        size_t from = atomic_fetch_add(&t->next, RUN);
        if (from >= (size_t)t->ndirs)
            break;
        for (Py_ssize_t d = (Py_ssize_t)from; d < t->ndirs && d < (Py_ssize_t)(from + RUN); d++) {
            if (atomic_load(&t->stop))
                break;
            t->dir_status[d] = t->dirs[d] ? chain_open(&c, t, t->dirs[d]) : EINVAL;
            if (t->dir_status[d] == DIR_OK)
                tree_dir(t, &c, d);
        }
    }
    chain_cut(&c, 0);
    return NULL;
}

PyDoc_STRVAR(unlink_tree_doc,
    "unlink_tree(top_fd, parent_fd, leaf, dev, ino, mnt, dirs, names, min_age, now, threads,\n"
    "            nice, dry_run)\n"
    "-> (list of (dir_status, list of (status, value) per name) per dir, moved: bool)\n\n"
    "unlink_batch for the names[i] of each dir dirs[i], a path below top_fd (whose entry\n"
    "`leaf` in parent_fd must stay the dir (dev, ino)), each opened a component at a time\n"
    "with O_NOFOLLOW and never on another mount than `mnt`. dir_status: 0 opened, an errno\n"
    "(its open failed), -1 on another mount, -2 not reached; its names are then not reached\n"
    "(6). Before each unlink every component is checked in its parent's entry. An unlink\n"
    "error stops its dir only; a moved dir stops all.");

/* The UTF-8 of str `s` (valid while `s` is), NULL if it holds a NUL (another name to the
 * kernel); -1 sets an exception. */
static int utf8_of(PyObject *s, const char **out) {
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(s, &len);
    if (u == NULL)
        return -1;
    *out = (Py_ssize_t)strlen(u) == len ? u : NULL;
    return 0;
}

static PyObject *tree_result(const Tree *t) {
    PyObject *out = PyList_New(t->ndirs);
    for (Py_ssize_t d = 0; out && d < t->ndirs; d++) {
        PyObject *names = PyList_New(t->first[d + 1] - t->first[d]);
        for (Py_ssize_t i = t->first[d]; names && i < t->first[d + 1]; i++) {
            PyObject *item = Py_BuildValue("(iL)", t->status[i], t->value[i]);
            if (item == NULL)
                Py_CLEAR(names);
            else
                PyList_SET_ITEM(names, i - t->first[d], item);
        }
        PyObject *dir = names ? Py_BuildValue("(iN)", t->dir_status[d], names) : NULL;
        if (dir == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, d, dir);
    }
    return out ? Py_BuildValue("(NO)", out, atomic_load(&t->moved) ? Py_True : Py_False) : NULL;
}

static PyObject *unlink_tree(PyObject *Py_UNUSED(self), PyObject *args) {
    Tree t;
    PyObject *dirs_arg, *names_arg, *out = NULL;
    unsigned long long dev, ino;
    int threads;
    memset(&t, 0, sizeof t);
    if (!PyArg_ParseTuple(args, "iisKKKOOddiip", &t.top_fd, &t.parent_fd, &t.leaf, &dev, &ino,
                          &t.mnt, &dirs_arg, &names_arg, &t.min_age, &t.now, &threads, &t.nice,
                          &t.dry_run))
        return NULL;
    t.dev = (dev_t)dev, t.ino = (ino_t)ino;
    if (!threads_ok(threads))
        return NULL;
    PyObject *dirs = PySequence_Fast(dirs_arg, "dirs must be a sequence");
    PyObject *lists = dirs ? PySequence_Fast(names_arg, "names must be a sequence") : NULL;
    PyObject **per_dir = NULL; /* each dir's names, as a fast sequence */
    if (lists == NULL)
        goto done;
    t.ndirs = PySequence_Fast_GET_SIZE(dirs);
    if (PySequence_Fast_GET_SIZE(lists) != t.ndirs) {
        PyErr_SetString(PyExc_ValueError, "one list of names per dir");
        goto done;
    }
    per_dir = PyMem_Calloc((size_t)t.ndirs + 1, sizeof *per_dir);
    t.dirs = PyMem_Calloc((size_t)t.ndirs + 1, sizeof *t.dirs);
    t.first = PyMem_Calloc((size_t)t.ndirs + 1, sizeof *t.first);
    t.dir_status = PyMem_Calloc((size_t)t.ndirs + 1, sizeof *t.dir_status);
    if (!per_dir || !t.dirs || !t.first || !t.dir_status) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t d = 0; d < t.ndirs; d++) {
        per_dir[d] = PySequence_Fast(PySequence_Fast_GET_ITEM(lists, d), "names of a dir");
        if (per_dir[d] == NULL || utf8_of(PySequence_Fast_GET_ITEM(dirs, d), &t.dirs[d]) < 0)
            goto done;
        t.first[d + 1] = t.first[d] + PySequence_Fast_GET_SIZE(per_dir[d]);
        t.dir_status[d] = -2;
    }
    Py_ssize_t n = t.first[t.ndirs];
    t.names = PyMem_Calloc((size_t)n + 1, sizeof *t.names);
    t.status = PyMem_Calloc((size_t)n + 1, sizeof *t.status);
    t.value = PyMem_Calloc((size_t)n + 1, sizeof *t.value);
    if (!t.names || !t.status || !t.value) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t d = 0; d < t.ndirs; d++) {
        for (Py_ssize_t i = t.first[d]; i < t.first[d + 1]; i++) {
            PyObject *name = PySequence_Fast_GET_ITEM(per_dir[d], i - t.first[d]);
            if (utf8_of(name, &t.names[i]) < 0)
                goto done;
            t.status[i] = NOT_REACHED;
        }
    }
    size_t runs = ((size_t)t.ndirs + RUN - 1) / RUN;
    if ((size_t)threads > runs)
        threads = runs > 0 ? (int)runs : 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_t tids[MAX_THREADS];
    int started = start_threads(tids, threads, tree_worker, &t);
    if (started == 0) {
        t.nice = 0;
        tree_worker(&t);
    }
    for (int i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    Py_END_ALLOW_THREADS
    out = tree_result(&t);
done:
    for (Py_ssize_t d = 0; per_dir && d < t.ndirs; d++)
        Py_XDECREF(per_dir[d]);
    PyMem_Free(per_dir);
    PyMem_Free(t.dirs);
    PyMem_Free(t.first);
    PyMem_Free(t.dir_status);
    PyMem_Free(t.names);
    PyMem_Free(t.status);
    PyMem_Free(t.value);
    Py_XDECREF(lists);
    Py_XDECREF(dirs);
    return out;
}

static PyMethodDef methods[] = {
    {"unlink_batch", unlink_batch, METH_VARARGS, unlink_batch_doc},
    {"unlink_tree", unlink_tree, METH_VARARGS, unlink_tree_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cachemgr.fs._unlink",
    .m_doc = "Checked unlinks of a batch of names in one directory or a tree, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__unlink(void) { return PyModule_Create(&module); }
