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
 * '/' check is repeated here since a name with one would leave dir_fd. A dry run does 1 only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_THREADS 16

/* One name's outcome; mirrored as cachemgr.fs.deletion's Outcome. */
enum status { DELETED, VANISHED, YOUNG, NOT_REGULAR, STAT_ERROR, UNLINK_ERROR, NOT_REACHED };

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

/* Steps 1-3 for name i; the status and value go to the batch's arrays. */
static void one(Batch *b, size_t i) {
    const char *name = b->names[i];
    struct stat st;
    /* NULL: the name held a NUL (below); a '/' would leave dir_fd. The caller's shape check
     * refuses both first. */
    if (name == NULL || strchr(name, '/') != NULL) {
        b->status[i] = STAT_ERROR, b->value[i] = EINVAL;
        return;
    }
    if (fstatat(b->dir_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        b->status[i] = errno == ENOENT ? VANISHED : STAT_ERROR, b->value[i] = errno;
        return;
    }
    if (!S_ISREG(st.st_mode)) {
        b->status[i] = NOT_REGULAR;
        return;
    }
    double mtime = (double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec * 1e-9;
    if (b->min_age > 0 && b->now - mtime < b->min_age) {
        b->status[i] = YOUNG;
        return;
    }
    if (!b->dry_run) {
        if (!still_here(b)) {
            atomic_store(&b->moved, 1);
            atomic_store(&b->stop, 1);
            return; /* stays NOT_REACHED */
        }
        if (unlinkat(b->dir_fd, name, 0) != 0) {
            if (errno == ENOENT) {
                b->status[i] = VANISHED;
                return;
            }
            b->status[i] = UNLINK_ERROR, b->value[i] = errno;
            atomic_store(&b->stop, 1);
            return;
        }
    }
    b->status[i] = DELETED, b->value[i] = (long long)st.st_size;
}

static void *worker(void *arg) {
    Batch *b = arg;
    /* Per thread on Linux; best effort (a failure only leaves the thread at the caller's). */
    if (b->nice != 0)
        setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), b->nice);
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

/* Run the batch on `threads` new threads at `nice` (the caller's own priority stays), or on
 * this one if none can be started. */
static void run(Batch *b, int threads) {
    pthread_t tids[MAX_THREADS];
    int started = 0;
    while (started < threads && pthread_create(&tids[started], NULL, worker, b) == 0)
        started++;
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
    "stops the batch), 6 not reached (the batch stopped first). `moved`: the dir left its\n"
    "parent's entry. The work runs on `threads` threads at niceness `nice`. Names must be\n"
    "UTF-8 (the caller's shape check admits ASCII only).");

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
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1..16");
        return NULL;
    }
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

static PyMethodDef methods[] = {
    {"unlink_batch", unlink_batch, METH_VARARGS, unlink_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cachemgr.fs._unlink",
    .m_doc = "Checked unlinks of a batch of names in one directory, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__unlink(void) { return PyModule_Create(&module); }
