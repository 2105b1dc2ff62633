/* cachemgr.fs._dirscan: list one directory and stat every entry, on several threads, without the
 * GIL; return per-name-shape aggregates instead of a Python object per file, and the number of
 * distinct pages (page keys) among the files.
 *
 * Why C: the index must stat every page (sizes are the metric), and a Python loop over
 * os.stat tops out at ~0.4x `du -sb` (os.stat ~3 us + a regex ~2.4 us per file). Here the
 * stats run on `threads` threads and no Python object is made per file, so a million-page
 * namespace is summarised faster than `du` walks it.
 *
 * Names are grouped by *shape* (the caller's format gives the rules, cachemgr.backends.ScanRules):
 * a leading run of key_min..key_max lowercase hex digits (the page key) is replaced by as many
 * '0's, so every page of one model/rank/pool falls into one group (keys of another length, in
 * another: a format may take some lengths only), and the temp_hex hex digits
 * after a leading temp_lead by '0's, so such temps share one group too. The caller's kind_of
 * classifies each shape once, with the GIL, when it is first seen -- the format guarantees the
 * verdict of a name and of its shape are the same. Files of one page share its key, so the
 * pages are the distinct keys among files whose shape is a page's (a set of 64-bit key hashes).
 *
 * Nested layouts (vLLM's hashed dirs): with `levels` > 0 the files are `levels` directories
 * below `dir_fd`; each subdirectory is kept only if dir_ok(level, name) says so (with the GIL)
 * and is opened with O_NOFOLLOW|O_DIRECTORY from its parent's descriptor, never through a link.
 * A dir on another mount than `dir_fd` (a filesystem or a bind mount an operator put there) is
 * never entered either: it is not the engine's, whatever its name.
 * Everything else at the upper levels counts as `other`. With threads > 1 the subtrees below
 * each dir two levels above the files are shared out to as many walkers (walk_split, below). A file's digest and page key are then
 * those of its path below `dir_fd` ("a_r0/0f3/a1_g0/<hash>.bin"), as the index names it.
 *
 * Safety: the caller opens the directory (cachemgr.fs.deletion.open_dir: no symlink on the way);
 * entries are stat'ed with AT_SYMLINK_NOFOLLOW; nothing is opened, written or deleted.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helper_nice.h"

#define CHUNK 65536       /* entries stat'ed per round: bounds memory for huge directories */
#define MAX_THREADS 16
#define MAX_SIZES 1024    /* distinct sizes tracked per group; more go to `untracked` */
#define RULE_MAX 128 /* longest key_max or temp_hex accepted (Ent.skip is 8 bits) */
#define SMALL 256    /* a dir with fewer entries is stat'ed on the calling thread */
#define MAX_LEVELS 8
#define PATH_MAX_LEN 4096
#define DENTS 32768 /* getdents64 buffer per level, as glibc's readdir */

enum kind { GONE = 0, REGULAR = 1, OTHER = 2 };

typedef struct {
    char *name;
    uint16_t len;
    uint8_t d_type;
    uint8_t kind;
    uint8_t prefix; /* PLAIN, PAGE_KEY or TEMP_KEY: what replaces name[0..skip) in the shape */
    uint8_t skip;
    int64_t size;
    double mtime;      /* as os.stat's st_mtime */
    uint64_t digest;   /* page_digest(name, size) */
    uint64_t shape_hash;
    uint64_t key_hash; /* of the page key (the whole name if it has none): one page, one hash */
} Ent;

typedef struct {
    int64_t size;
    int64_t count;
} SizeCount;

typedef struct {
    char *key; /* the name's shape (owned) */
    size_t keylen;
    uint64_t hash;
    int64_t count, bytes, untracked;
    uint64_t digest;
    SizeCount *sizes; /* grown on demand: most groups (a foreign name) hold one size */
    int nsizes, capsizes;
    int kind; /* kind_of(shape): 1 is a page */
    int key_len; /* of a page shape when rows are stored: key_len_of(shape), 0 for none */
} Group;

typedef struct {
    Group **slots;
    size_t cap, used;
} Groups;

enum prefix { PLAIN = 0, PAGE_KEY = 1, TEMP_KEY = 2 };

#define VERDICTS 16384 /* cached dir_ok answers: 4096 + 256·groups names in vLLM's layout */
typedef struct {
    uint64_t hash; /* 0: a free slot */
    int level;
    int8_t ok;
    uint8_t len;
    char name[256];
} Verdict;
enum { PAGE = 1 }; /* cachemgr.backends.FileKind.PAGE */

/* The format's shape rules, and the shape prefix each rule puts in place of what it replaces. */
typedef struct {
    size_t key_min, key_max, temp_hex;
    char temp_lead;
    char prefix[3][RULE_MAX + 2]; /* a shape's first `Ent.skip` characters */
} Rules;
#define FNV_SEED 0xcbf29ce484222325ULL

/* FNV-1a, then a 64-bit finaliser (splitmix64) so near-identical names spread over all bits. */
static uint64_t mix(uint64_t h) {
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    return h ^ (h >> 31);
}

static uint64_t fnv(const char *s, size_t n, uint64_t h) {
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

/* The digest of one (page name, size): XOR-summed per namespace by the scan and, through
 * page_digest(), by the state DB's triggers; equal digests mean the index matches the dir. */
static uint64_t page_digest(uint64_t seed, const char *name, size_t len, int64_t size) {
    return mix(fnv(name, len, seed) ^ mix((uint64_t)size + 0x9e3779b97f4a7c15ULL));
}

static size_t hex_run(const char *s, size_t n) {
    size_t i = 0;
    while (i < n && ((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
        i++;
    return i;
}

/* The mount id of an open file (statx STATX_MNT_ID); 0 if the kernel cannot say. */
static uint64_t mount_of(int fd) {
    struct statx stx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID, &stx) != 0 || !(stx.stx_mask & STATX_MNT_ID))
        return 0;
    return stx.stx_mnt_id;
}

/* A name's shape: prefix[prefix] + name[skip:]; and the hash of its page key. */
static void shape_of(const Rules *r, uint64_t seed, Ent *e) {
    size_t hex = hex_run(e->name, e->len);
    e->prefix = PLAIN, e->skip = 0;
    if (hex >= r->key_min && hex <= r->key_max) {
        e->prefix = PAGE_KEY, e->skip = (uint8_t)hex;
    } else if (e->name[0] == r->temp_lead && hex_run(e->name + 1, e->len - 1) == r->temp_hex) {
        e->prefix = TEMP_KEY, e->skip = (uint8_t)(1 + r->temp_hex);
    }
    uint64_t h = fnv(r->prefix[e->prefix], e->skip, FNV_SEED);
    e->shape_hash = mix(fnv(e->name + e->skip, e->len - e->skip, h));
    e->key_hash = mix(fnv(e->name, e->prefix == PAGE_KEY ? hex : e->len, seed));
}

static int shape_equals(const Rules *r, const Group *x, const Ent *e) {
    size_t rest = (size_t)(e->len - e->skip), head = e->skip;
    return x->hash == e->shape_hash && x->keylen == head + rest &&
           memcmp(x->key, r->prefix[e->prefix], head) == 0 &&
           memcmp(x->key + head, e->name + e->skip, rest) == 0;
}

/* A set of 64-bit key hashes (0 marks a free slot): how many distinct pages there are. */
typedef struct {
    uint64_t *slots;
    size_t cap, used;
} KeySet;

static int keyset_grow(KeySet *s) {
    size_t cap = s->cap ? s->cap * 2 : 1024;
    uint64_t *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -1;
    for (size_t i = 0; i < s->cap; i++) {
        uint64_t h = s->slots[i];
        if (!h)
            continue;
        size_t j = h & (cap - 1);
        while (slots[j])
            j = (j + 1) & (cap - 1);
        slots[j] = h;
    }
    free(s->slots);
    s->slots = slots;
    s->cap = cap;
    return 0;
}

/* Add `h`: 1 if it is new, 0 if it was there, -1 when out of memory. */
static int keyset_add(KeySet *s, uint64_t h) {
    if ((s->used + 1) * 2 > s->cap && keyset_grow(s) < 0)
        return -1;
    h = h ? h : 1;
    size_t j = h & (s->cap - 1);
    for (; s->slots[j]; j = (j + 1) & (s->cap - 1)) {
        if (s->slots[j] == h)
            return 0;
    }
    s->slots[j] = h;
    s->used++;
    return 1;
}

static void groups_free(Groups *g) {
    for (size_t i = 0; i < g->cap; i++) {
        if (g->slots[i]) {
            free(g->slots[i]->key);
            free(g->slots[i]->sizes);
            free(g->slots[i]);
        }
    }
    free(g->slots);
}

static int groups_grow(Groups *g) {
    size_t cap = g->cap ? g->cap * 2 : 64;
    Group **slots = calloc(cap, sizeof *slots);
    if (!slots)
        return -1;
    for (size_t i = 0; i < g->cap; i++) {
        Group *x = g->slots[i];
        if (!x)
            continue;
        size_t j = x->hash & (cap - 1);
        while (slots[j])
            j = (j + 1) & (cap - 1);
        slots[j] = x;
    }
    free(g->slots);
    g->slots = slots;
    g->cap = cap;
    return 0;
}

/* The group of `e`'s shape, created (kind -1: not classified yet) on first sight; NULL when out
 * of memory. */
static Group *group_of(Groups *g, const Rules *r, const Ent *e) {
    if ((g->used + 1) * 2 > g->cap && groups_grow(g) < 0)
        return NULL;
    size_t j = e->shape_hash & (g->cap - 1);
    for (Group *x; (x = g->slots[j]); j = (j + 1) & (g->cap - 1)) {
        if (shape_equals(r, x, e))
            return x;
    }
    size_t rest = (size_t)(e->len - e->skip), head = e->skip;
    Group *x = calloc(1, sizeof *x);
    char *key = malloc(head + rest + 1);
    if (!x || !key) {
        free(x);
        free(key);
        return NULL;
    }
    memcpy(key, r->prefix[e->prefix], head);
    memcpy(key + head, e->name + e->skip, rest);
    key[head + rest] = '\0';
    x->key = key;
    x->keylen = head + rest;
    x->hash = e->shape_hash;
    x->kind = -1;
    g->slots[j] = x;
    g->used++;
    return x;
}

/* Room for one more distinct size in x's list (grown up to MAX_SIZES); 0 if there is none. */
static int size_room(Group *x) {
    if (x->nsizes == x->capsizes && x->capsizes < MAX_SIZES) {
        int cap = x->capsizes ? x->capsizes * 2 : 1;
        SizeCount *grown = realloc(x->sizes, (size_t)cap * sizeof *grown);
        if (grown) { /* out of memory: the size goes untracked, nothing is lost */
            x->sizes = grown;
            x->capsizes = cap;
        }
    }
    return x->nsizes < x->capsizes;
}

/* Count `count` files of `size` among x's sizes (as untracked if the list is full). */
static void size_add(Group *x, int64_t size, int64_t count) {
    for (int i = 0; i < x->nsizes; i++) {
        if (x->sizes[i].size == size) {
            x->sizes[i].count += count;
            return;
        }
    }
    if (size_room(x))
        x->sizes[x->nsizes++] = (SizeCount){size, count};
    else
        x->untracked += count;
}

static void group_add(Group *x, const Ent *e) {
    x->count++;
    x->bytes += e->size;
    x->digest ^= e->digest;
    size_add(x, e->size, 1);
}

typedef struct {
    int dirfd;
    const Rules *rules;
    uint64_t seed; /* fnv of the dir's path below the scanned dir: names hash as full paths */
    Ent *ents;
    size_t n, first, step;
    int nice; /* how much nicer the stat threads run than the caller (helper_nice.h) */
} Job;

/* Stat and hash every step-th entry from `first`: the per-file work, off the main thread. */
static void *stat_slice(void *arg) {
    Job *job = arg;
    for (size_t i = job->first; i < job->n; i += job->step) {
        Ent *e = &job->ents[i];
        if (e->d_type != DT_REG && e->d_type != DT_UNKNOWN) {
            e->kind = OTHER; /* the dirent already says: not a regular file */
            continue;
        }
        struct stat st;
        if (fstatat(job->dirfd, e->name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            e->kind = errno == ENOENT ? GONE : OTHER; /* GONE: deleted since it was listed */
            continue;
        }
        e->kind = S_ISREG(st.st_mode) ? REGULAR : OTHER;
        e->size = st.st_size;
        e->mtime = (double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec * 1e-9;
        if (e->kind == REGULAR) {
            e->digest = page_digest(job->seed, e->name, e->len, e->size);
            shape_of(job->rules, job->seed, e);
        }
    }
    return NULL;
}

/* stat_slice on a thread of its own, niced (helper_nice.h): a first start's walk of a huge dir
 * kept every core busy with these threads, and a /metrics scrape waited for a core (stalls of
 * 10-60 ms in bench_scale.py's walk of 2M pages); niced, they give way to the daemon's HTTP
 * thread and to the engine's own threads. */
static void *stat_thread(void *arg) {
    const Job *job = arg;
    helper_nice(job->nice);
    return stat_slice(arg);
}

typedef struct {
    pthread_t tid[MAX_THREADS];
    Job jobs[MAX_THREADS];
    int started;
} Crew;

/* Start `threads` threads on ents[0..n); a thread that cannot start is run at join time. */
static void crew_start(Crew *c, int dirfd, const Rules *r, uint64_t seed, Ent *ents, size_t n,
                       int threads, int nice) {
    c->started = 0;
    for (int t = 0; t < threads; t++) {
        c->jobs[t] = (Job){dirfd, r, seed, ents, n, (size_t)t, (size_t)threads, nice};
        /* a small dir is not worth a thread: the join runs it here */
        if (n >= SMALL && c->started == t &&
            pthread_create(&c->tid[t], NULL, stat_thread, &c->jobs[t]) == 0)
            c->started++;
    }
}

static void crew_join(Crew *c, int threads) {
    for (int t = 0; t < c->started; t++)
        pthread_join(c->tid[t], NULL);
    for (int t = c->started; t < threads; t++)
        stat_slice(&c->jobs[t]);
}

typedef struct sqlite3 sqlite3;
typedef struct sqlite3_stmt sqlite3_stmt;

/* The SQL functions the `pages` triggers keep namespace_stats.digest with (migration 0004), in
 * C: registered from Python, each call of a trigger (three a row stored) took the GIL in the
 * middle of an SQLite step that had let it go, and waited up to a switch interval for it
 * behind the daemon's GC and watcher threads (bench/RESULTS.md). The few SQLite calls they
 * need are looked up in the very SQLite the sqlite3 module runs on (its extension's own
 * symbols and libraries): no header, no link of our own, so a second copy of SQLite never
 * sees its handles; if they cannot be found the caller registers the Python ones. A scan
 * stores its page rows through the same calls (Rows, below). */
typedef struct sqlite3_context sqlite3_context;
typedef struct sqlite3_value sqlite3_value;
typedef void (*sql_fn)(sqlite3_context *, int, sqlite3_value **);
#define SQL_INTEGER 1
#define SQL_TEXT 3
#define SQL_UTF8 1
#define SQL_DETERMINISTIC 0x800
#define SQL_DONE 101
#define SQL_TRANSIENT ((void (*)(void *))-1)

static struct {
    int (*create_function)(sqlite3 *, const char *, int, int, void *, sql_fn, sql_fn,
                           void (*)(sqlite3_context *), void (*)(void *));
    int (*value_type)(sqlite3_value *);
    const unsigned char *(*value_text)(sqlite3_value *);
    int (*value_bytes)(sqlite3_value *);
    long long (*value_int64)(sqlite3_value *);
    void (*result_int64)(sqlite3_context *, long long);
    void (*result_error)(sqlite3_context *, const char *, int);
    int (*prepare)(sqlite3 *, const char *, int, sqlite3_stmt **, const char **);
    int (*bind_text)(sqlite3_stmt *, int, const char *, int, void (*)(void *));
    int (*bind_int64)(sqlite3_stmt *, int, long long);
    int (*bind_double)(sqlite3_stmt *, int, double);
    int (*step)(sqlite3_stmt *);
    int (*reset)(sqlite3_stmt *);
    int (*finalize)(sqlite3_stmt *);
    const char *(*errmsg)(sqlite3 *);
    sqlite3 *(*db_handle)(sqlite3_stmt *);
} sq;

/* The connection object's layout in every CPython 3 (Modules/_sqlite/connection.h). */
typedef struct {
    PyObject_HEAD
    sqlite3 *db;
} Connection;

static void sql_page_digest(sqlite3_context *ctx, int argc, sqlite3_value **argv) {
    (void)argc;
    if (sq.value_type(argv[0]) != SQL_TEXT || sq.value_type(argv[1]) != SQL_INTEGER) {
        sq.result_error(ctx, "cachemgr_page_digest(name, size): a text and an integer", -1);
        return;
    }
    const char *name = (const char *)sq.value_text(argv[0]);
    size_t len = (size_t)sq.value_bytes(argv[0]);
    uint64_t d = page_digest(FNV_SEED, name, len, (int64_t)sq.value_int64(argv[1]));
    sq.result_int64(ctx, (long long)(int64_t)d);
}

static void sql_xor(sqlite3_context *ctx, int argc, sqlite3_value **argv) {
    (void)argc;
    if (sq.value_type(argv[0]) != SQL_INTEGER || sq.value_type(argv[1]) != SQL_INTEGER) {
        sq.result_error(ctx, "cachemgr_xor(a, b): two integers", -1);
        return;
    }
    sq.result_int64(ctx, sq.value_int64(argv[0]) ^ sq.value_int64(argv[1]));
}

/* dlsym `name` in `h` into `call`, a field of `sq`; 0 if it is not there. */
static int find_call(void *h, const char *name, void *call) {
    void *f = dlsym(h, name);
    memcpy(call, &f, sizeof f); /* (a data pointer into a call pointer: POSIX's dlsym idiom) */
    return f != NULL;
}

/* Find SQLite's calls in `lib` (the sqlite3 module's extension, loaded already). */
static int find_sqlite(const char *lib) {
    if (sq.create_function != NULL)
        return 1;
    void *h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
    if (h == NULL)
        return 0;
    void *create = dlsym(h, "sqlite3_create_function_v2");
    int found = create != NULL && find_call(h, "sqlite3_value_type", &sq.value_type) &&
                find_call(h, "sqlite3_value_text", &sq.value_text) &&
                find_call(h, "sqlite3_value_bytes", &sq.value_bytes) &&
                find_call(h, "sqlite3_value_int64", &sq.value_int64) &&
                find_call(h, "sqlite3_result_int64", &sq.result_int64) &&
                find_call(h, "sqlite3_result_error", &sq.result_error) &&
                find_call(h, "sqlite3_prepare_v2", &sq.prepare) &&
                find_call(h, "sqlite3_bind_text", &sq.bind_text) &&
                find_call(h, "sqlite3_bind_int64", &sq.bind_int64) &&
                find_call(h, "sqlite3_bind_double", &sq.bind_double) &&
                find_call(h, "sqlite3_step", &sq.step) && find_call(h, "sqlite3_reset", &sq.reset) &&
                find_call(h, "sqlite3_finalize", &sq.finalize) &&
                find_call(h, "sqlite3_errmsg", &sq.errmsg) &&
                find_call(h, "sqlite3_db_handle", &sq.db_handle);
    dlclose(h); /* (NOLOAD: the module keeps it loaded) */
    if (found)  /* last: the flag that all of them are there */
        memcpy(&sq.create_function, &create, sizeof create);
    return found;
}

/* Where scan(..., rows) stores a row per page file as the walk meets it: an INSERT prepared
 * on the caller's connection, stepped by every walker in turn. */
typedef struct {
    sqlite3_stmt *stmt;
    pthread_mutex_t lock;
    double at;  /* a later mtime is stored as this (a clock set back, a copied tree) */
    int rc;     /* SQLite's code for the first failed step, 0 if none */
    char msg[256];
} Rows;

typedef struct {
    Rules rules;
    int threads, levels;
    int nice;  /* how much nicer the stat threads run (Job) */
    int split; /* the level whose subdirs are walked on `threads` threads; -1: none */
    PyObject *kind_of;   /* shape -> FileKind, called with the GIL */
    PyObject *key_len_of; /* page shape -> its key's length (or None), with rows only */
    Rows *rows;          /* NULL: count only */
    PyObject *dir_ok;    /* (level, name) -> bool for the dirs above the files; NULL: no levels */
    Verdict *verdicts;   /* dir_ok's answers so far, VERDICTS slots (NULL: none kept) */
    size_t nverdicts;
    Ent *cur, *next;     /* the chunk being stat'ed and the one being read */
    char path[PATH_MAX_LEN]; /* the current dir below the scanned one, '/'-terminated */
    size_t path_len;
    char *dents[MAX_LEVELS + 1]; /* a getdents buffer per level (Dir), allocated when used */
    PyThreadState *save; /* this thread's state while the GIL is released */
    Groups groups;
    KeySet keys; /* of the page files seen */
    int64_t other, gone;
    uint64_t mnt; /* the mount of the scanned dir: dirs below on another are not entered */
    int err;    /* errno of a failure, 0 if none */
    int py_err; /* kind_of raised: its exception is pending */
} Totals;

/* kind_of(shape) for a group seen the first time; takes the GIL for the call. */
static void classify(Group *x, Totals *tot) {
    PyEval_RestoreThread(tot->save);
    PyObject *shape = PyUnicode_DecodeFSDefaultAndSize(x->key, (Py_ssize_t)x->keylen);
    PyObject *kind = shape ? PyObject_CallOneArg(tot->kind_of, shape) : NULL;
    long k = kind ? PyLong_AsLong(kind) : -1;
    if (k == -1 && PyErr_Occurred())
        tot->py_err = 1;
    if (k == PAGE && tot->rows && !tot->py_err) {
        PyObject *n = PyObject_CallOneArg(tot->key_len_of, shape);
        long len = n == Py_None ? 0 : n ? PyLong_AsLong(n) : -1;
        if (len == -1 && PyErr_Occurred())
            tot->py_err = 1;
        x->key_len = (int)len;
        Py_XDECREF(n);
    }
    Py_XDECREF(kind);
    Py_XDECREF(shape);
    tot->save = PyEval_SaveThread();
    x->kind = (int)k;
}

/* A directory read with getdents64 into a buffer of the walker's, one per level: a DIR would
 * cost an fstat, an fcntl and a 32 KiB allocation per dir (fdopendir), in vLLM's layout nearly
 * one per block. */
typedef struct {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
} Dirent;

typedef struct {
    int fd;
    char *buf; /* DENTS bytes */
    long len, pos;
} Dir;

/* Dir `fd` (at `level`: its buffer) from its first entry; 0 if out of memory (fd stays open). */
static int dir_open(Dir *dir, int fd, int level, Totals *tot) {
    if (!tot->dents[level] && !(tot->dents[level] = malloc(DENTS))) {
        tot->err = ENOMEM;
        return 0;
    }
    *dir = (Dir){.fd = fd, .buf = tot->dents[level]};
    return 1;
}

/* The next entry of `dir` but "." and ".."; NULL at the end or on an error (in tot->err). */
static Dirent *next_entry(Dir *dir, Totals *tot) {
    for (;;) {
        if (dir->pos >= dir->len) {
            long n = syscall(SYS_getdents64, dir->fd, dir->buf, DENTS);
            if (n <= 0) {
                tot->err = n < 0 ? errno : 0;
                return NULL;
            }
            dir->len = n, dir->pos = 0;
        }
        Dirent *d = (Dirent *)(dir->buf + dir->pos);
        dir->pos += d->d_reclen;
        const char *s = d->d_name;
        if (!(s[0] == '.' && (!s[1] || (s[1] == '.' && !s[2]))))
            return d;
    }
}

/* Read up to CHUNK entries into `ents`; returns how many, 0 at the end. */
static size_t read_chunk(Dir *dir, Ent *ents, Totals *tot) {
    size_t n = 0;
    Dirent *d;
    while (n < CHUNK && !tot->err && !tot->py_err && (d = next_entry(dir, tot))) {
        const char *s = d->d_name;
        size_t len = strlen(s);
        if (len > 255) { /* longer than NAME_MAX: no name cachemgr knows */
            tot->other++;
            continue;
        }
        char *copy = malloc(len + 1);
        if (!copy) {
            tot->err = ENOMEM;
            break;
        }
        memcpy(copy, s, len + 1);
        ents[n++] = (Ent){.name = copy, .len = (uint16_t)len, .d_type = d->d_type};
    }
    return n;
}

/* The characters of UTF-8 text: its bytes but continuation bytes (10xxxxxx). */
static int utf8_chars(const char *s, size_t n) {
    int chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += ((unsigned char)s[i] & 0xC0) != 0x80;
    return chars;
}

/* Store e's row: (its path below the scanned dir, size, mtime, key length). Walkers take
 * turns; the first failure stops them all (tot->err) and is kept for scan() to raise. */
static void row_add(Totals *tot, const Group *x, const Ent *e) {
    Rows *r = tot->rows;
    char name[PATH_MAX_LEN + 256];
    size_t n = tot->path_len;
    memcpy(name, tot->path, n);
    memcpy(name + n, e->name, e->len);
    n += e->len;
    /* a nested page's key is its whole path (cachemgr.backends), counted in characters as
     * Python and SQLite's length() count them: a model's name in a vLLM folder may be any
     * UTF-8 (the dir patterns refuse what is not) */
    int key_len = x->key_len && tot->path_len ? utf8_chars(name, n) : x->key_len;
    double mtime = e->mtime < r->at ? e->mtime : r->at;
    pthread_mutex_lock(&r->lock);
    if (!r->rc) {
        sqlite3_stmt *s = r->stmt;
        int rc = sq.bind_text(s, 1, name, (int)n, SQL_TRANSIENT);
        rc = rc ? rc : sq.bind_int64(s, 2, e->size);
        rc = rc ? rc : sq.bind_double(s, 3, mtime);
        rc = rc ? rc : sq.bind_int64(s, 4, key_len);
        rc = rc ? rc : sq.step(s);
        if (rc != SQL_DONE) {
            r->rc = rc ? rc : -1;
            snprintf(r->msg, sizeof r->msg, "%s", sq.errmsg(sq.db_handle(s)));
        }
        sq.reset(s);
    }
    int failed = r->rc != 0;
    pthread_mutex_unlock(&r->lock);
    if (failed)
        tot->err = EIO;
}

static void tally(Ent *ents, size_t n, Totals *tot) {
    for (size_t i = 0; i < n; i++) {
        Ent *e = &ents[i];
        if (tot->err || tot->py_err) {
            /* keep freeing */
        } else if (e->kind == REGULAR) {
            Group *x = group_of(&tot->groups, &tot->rules, e);
            if (x && x->kind < 0)
                classify(x, tot);
            if (x)
                group_add(x, e);
            if (!x || (x->kind == PAGE && keyset_add(&tot->keys, e->key_hash) < 0))
                tot->err = ENOMEM;
            else if (x->kind == PAGE && tot->rows)
                row_add(tot, x, e);
        } else if (e->kind == OTHER) {
            tot->other++;
        } else {
            tot->gone++;
        }
        free(e->name);
    }
}

/* Walk the files of `dirfd`, reading the next chunk of names while the threads stat the
 * current one; runs without the GIL (but for classify()). Takes ownership of dirfd. */
static void walk(int dirfd, Totals *tot) {
    Dir dir;
    if (!dir_open(&dir, dirfd, tot->levels, tot)) {
        close(dirfd);
        return;
    }
    uint64_t seed = fnv(tot->path, tot->path_len, FNV_SEED);
    size_t n = read_chunk(&dir, tot->cur, tot);
    while (n) {
        Crew crew;
        crew_start(&crew, dirfd, &tot->rules, seed, tot->cur, n, tot->threads, tot->nice);
        size_t m = read_chunk(&dir, tot->next, tot);
        crew_join(&crew, tot->threads);
        tally(tot->cur, n, tot);
        Ent *t = tot->cur;
        tot->cur = tot->next;
        tot->next = t;
        n = m;
    }
    close(dirfd);
}

/* dir_ok(level, name), with the GIL: 1 keep, 0 skip, -1 it raised. A hashed layout repeats
 * a few thousand dir names across a million dirs, so each (level, name) is asked once. */
static int dir_ok(Totals *tot, int level, const char *name, size_t len) {
    uint64_t h = mix(fnv(name, len, FNV_SEED + (uint64_t)level)) | 1;
    size_t j = h & (VERDICTS - 1);
    for (Verdict *v; tot->verdicts && (v = &tot->verdicts[j])->hash; j = (j + 1) & (VERDICTS - 1)) {
        if (v->hash == h && v->level == level && v->len == len && !memcmp(v->name, name, len))
            return v->ok;
    }
    PyEval_RestoreThread(tot->save);
    PyObject *ok = PyObject_CallFunction(tot->dir_ok, "iy#", level, name, (Py_ssize_t)len);
    int r = ok ? PyObject_IsTrue(ok) : -1;
    Py_XDECREF(ok);
    tot->save = PyEval_SaveThread();
    if (r >= 0 && tot->verdicts && tot->nverdicts * 2 < VERDICTS && len < 256) {
        Verdict *v = &tot->verdicts[j];
        *v = (Verdict){.hash = h, .level = level, .ok = (int8_t)r, .len = (uint8_t)len};
        memcpy(v->name, name, len);
        tot->nverdicts++;
    }
    return r;
}

/* Open subdirectory `name` of `dirfd` if it is a dir dir_ok keeps: its fd, or -1 (counted). */
static int open_sub(int dirfd, const char *name, size_t len, unsigned char d_type, int level,
                    Totals *tot) {
    if (d_type != DT_DIR && d_type != DT_UNKNOWN) {
        tot->other++;
        return -1;
    }
    int ok = dir_ok(tot, level, name, len);
    if (ok < 0) {
        tot->py_err = 1;
        return -1;
    }
    int fd = ok ? openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
    if (fd < 0) { /* not kept, a symlink or a file (ELOOP, ENOTDIR), or gone since listed */
        if (ok && errno == ENOENT)
            tot->gone++;
        /* an unreadable dir (EACCES: someone's chmod) is not entered: the rest still counts */
        else if (ok && errno != ELOOP && errno != ENOTDIR && errno != EACCES && errno != EPERM)
            tot->err = errno;
        else
            tot->other++;
    } else if (mount_of(fd) != tot->mnt) { /* a mount point: another filesystem's files */
        close(fd);
        tot->other++;
        return -1;
    }
    return fd;
}

static void walk_tree(int fd0, int level, Totals *tot);

/* Enter subdirectory `name` of `dirfd` (at `level`) if it is one to walk, and walk it. */
static void enter(int dirfd, const char *name, unsigned char d_type, int level, Totals *tot) {
    size_t at = tot->path_len, len = strlen(name);
    if (at + len + 2 > PATH_MAX_LEN) {
        tot->other++;
        return;
    }
    int fd = open_sub(dirfd, name, len, d_type, level, tot);
    if (fd < 0)
        return;
    memcpy(tot->path + at, name, len);
    tot->path[at + len] = '/';
    tot->path_len = at + len + 1;
    walk_tree(fd, level + 1, tot);
    tot->path_len = at;
}

/* The parallel walk (`threads` > 1, nested layouts): vLLM's hashed layout has a dir per block
 * or so, so the stat threads of walk() never start and the walk is one openat + getdents per
 * dir, on one thread. Instead the subdirs of each dir at level `split` (a rank dir's 4,096
 * `<hhh>` dirs) are shared out to `threads` walkers, this thread one of them, each with totals
 * of its own merged into the caller's at the end: the same groups, counts and key set as one
 * walker makes (sizes past a group's first MAX_SIZES distinct ones aside: which ones count as
 * `untracked` depends on the order files are met). Each walker opens its subdirs from the
 * shared dir's descriptor exactly as walk_tree() does (open_sub: O_NOFOLLOW, dir_ok, mount
 * check), and calls dir_ok and kind_of with the GIL like this thread (a Python thread state
 * of its own; an exception it raised is re-raised by the caller). */
typedef struct {
    char *name;
    unsigned char d_type;
} Item;

typedef struct {
    int fd, level;
    Item *items;
    size_t n;
    atomic_size_t next;
    atomic_int stop; /* a walker failed: the others take no more subdirs */
} Pool;

typedef struct {
    Pool *pool;
    Totals tot;
    PyObject *exc[3]; /* the exception its dir_ok or kind_of raised */
} Walker;

/* A walker's totals: the caller's rules and callbacks, nothing found yet; 0 if out of memory. */
static int totals_like(Totals *t, const Totals *of) {
    *t = (Totals){.rules = of->rules, .threads = of->threads, .levels = of->levels, .split = -1,
                  .nice = of->nice,
                  .kind_of = of->kind_of, .key_len_of = of->key_len_of, .rows = of->rows,
                  .dir_ok = of->dir_ok, .mnt = of->mnt,
                  .path_len = of->path_len};
    memcpy(t->path, of->path, of->path_len);
    t->cur = malloc(CHUNK * sizeof *t->cur);
    t->next = malloc(CHUNK * sizeof *t->next);
    t->verdicts = calloc(VERDICTS, sizeof *t->verdicts);
    return t->cur && t->next && t->verdicts;
}

static void totals_free(Totals *t) {
    for (int i = 0; i <= MAX_LEVELS; i++)
        free(t->dents[i]);
    free(t->cur);
    free(t->next);
    free(t->verdicts);
    free(t->keys.slots);
    groups_free(&t->groups);
}

static void pool_run(Pool *p, Totals *tot) {
    while (!atomic_load(&p->stop) && !tot->err && !tot->py_err) {
        size_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n)
            return;
        enter(p->fd, p->items[i].name, p->items[i].d_type, p->level, tot);
    }
    atomic_store(&p->stop, 1);
}

static void *walker_main(void *arg) {
    Walker *w = arg;
    /* niced as the stat threads are: a vLLM tree's first walk ran its walkers at the daemon's
     * priority, beside its HTTP thread */
    helper_nice(w->tot.nice);
    PyGILState_STATE g = PyGILState_Ensure();
    w->tot.save = PyEval_SaveThread();
    pool_run(w->pool, &w->tot);
    PyEval_RestoreThread(w->tot.save);
    if (w->tot.py_err)
        PyErr_Fetch(&w->exc[0], &w->exc[1], &w->exc[2]);
    PyGILState_Release(g);
    return NULL;
}

/* Add group `x` of another walker to `g` (taking it if `g` has no group of its shape); 0 if out
 * of memory. */
static int group_merge(Groups *g, Group *x) {
    if ((g->used + 1) * 2 > g->cap && groups_grow(g) < 0)
        return 0;
    size_t j = x->hash & (g->cap - 1);
    Group *y;
    for (; (y = g->slots[j]); j = (j + 1) & (g->cap - 1)) {
        if (y->hash == x->hash && y->keylen == x->keylen && !memcmp(y->key, x->key, x->keylen))
            break;
    }
    if (!y) {
        g->slots[j] = x;
        g->used++;
        return 1;
    }
    y->kind = y->kind < 0 ? x->kind : y->kind;
    y->untracked += x->untracked;
    for (int i = 0; i < x->nsizes; i++)
        size_add(y, x->sizes[i].size, x->sizes[i].count);
    y->count += x->count;
    y->bytes += x->bytes;
    y->digest ^= x->digest;
    free(x->key);
    free(x->sizes);
    free(x);
    return 1;
}

/* Fold walker totals `from` into `into`; `from` is left empty. */
static void totals_merge(Totals *into, Totals *from) {
    into->other += from->other;
    into->gone += from->gone;
    into->err = into->err ? into->err : from->err;
    for (size_t i = 0; i < from->groups.cap; i++) {
        Group *x = from->groups.slots[i];
        from->groups.slots[i] = NULL;
        if (x && !group_merge(&into->groups, x)) {
            into->err = ENOMEM;
            free(x->key), free(x->sizes), free(x);
        }
    }
    for (size_t i = 0; i < from->keys.cap && !into->err; i++) {
        if (from->keys.slots[i] && keyset_add(&into->keys, from->keys.slots[i]) < 0)
            into->err = ENOMEM;
    }
}

/* Walk the subdirs of `dir` (at `level`) on tot->threads walkers, this thread one of them. */
static void walk_split(Dir *dir, int level, Totals *tot) {
    Pool p = {.fd = dir->fd, .level = level};
    size_t cap = 0;
    Dirent *d;
    while (!tot->err && (d = next_entry(dir, tot))) {
        if (p.n == cap) {
            cap = cap ? cap * 2 : 256;
            Item *grown = realloc(p.items, cap * sizeof *grown);
            if (!grown) {
                tot->err = ENOMEM;
                break;
            }
            p.items = grown;
        }
        p.items[p.n] = (Item){strdup(d->d_name), d->d_type};
        if (!p.items[p.n++].name)
            tot->err = ENOMEM;
    }
    pthread_t tid[MAX_THREADS];
    int extra = tot->threads - 1, started = 0;
    Walker *w = tot->err ? NULL : calloc((size_t)extra, sizeof *w);
    for (; w && started < extra; started++) { /* a walker that cannot start: the rest walk */
        w[started].pool = &p;
        if (!totals_like(&w[started].tot, tot) ||
            pthread_create(&tid[started], NULL, walker_main, &w[started]) != 0) {
            totals_free(&w[started].tot);
            break;
        }
    }
    if (!tot->err)
        pool_run(&p, tot);
    for (int t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    PyEval_RestoreThread(tot->save); /* the first exception is re-raised, the others dropped */
    for (int t = 0; t < started; t++) {
        PyObject **exc = w[t].exc;
        if (exc[0] && !tot->py_err) {
            PyErr_Restore(exc[0], exc[1], exc[2]);
            tot->py_err = 1;
        } else {
            Py_XDECREF(exc[0]), Py_XDECREF(exc[1]), Py_XDECREF(exc[2]);
        }
    }
    tot->save = PyEval_SaveThread();
    for (int t = 0; t < started; t++) {
        totals_merge(tot, &w[t].tot);
        totals_free(&w[t].tot);
    }
    for (size_t i = 0; i < p.n; i++)
        free(p.items[i].name);
    free(p.items);
    free(w);
}

/* Walk `levels - level` dirs down to the files; takes ownership of dirfd. */
static void walk_tree(int fd0, int level, Totals *tot) {
    if (level == tot->levels) {
        walk(fd0, tot);
        return;
    }
    Dir dir;
    if (!dir_open(&dir, fd0, level, tot)) {
        close(fd0);
        return;
    }
    if (level == tot->split) {
        walk_split(&dir, level, tot);
    } else {
        Dirent *d;
        while (!tot->err && !tot->py_err && (d = next_entry(&dir, tot)))
            enter(fd0, d->d_name, d->d_type, level, tot);
    }
    close(fd0);
}

static PyObject *group_tuple(const Group *x) {
    PyObject *sizes = PyDict_New();
    if (!sizes)
        return NULL;
    for (int i = 0; i < x->nsizes; i++) {
        PyObject *k = PyLong_FromLongLong(x->sizes[i].size);
        PyObject *v = PyLong_FromLongLong(x->sizes[i].count);
        int bad = !k || !v || PyDict_SetItem(sizes, k, v) < 0;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (bad) {
            Py_DECREF(sizes);
            return NULL;
        }
    }
    PyObject *key = PyUnicode_DecodeFSDefaultAndSize(x->key, (Py_ssize_t)x->keylen);
    if (!key) {
        Py_DECREF(sizes);
        return NULL;
    }
    return Py_BuildValue("(NiLLLLN)", key, x->kind, (long long)x->count, (long long)x->bytes,
                         (long long)(int64_t)x->digest, (long long)x->untracked, sizes);
}

PyDoc_STRVAR(scan_doc,
"scan(dir_fd, threads, rules, kind_of, levels=0, dir_ok=None, rows=None, nice=0) -> (groups, other, gone, pages)\n\n"
"List the open directory `dir_fd` and stat every entry (not following symlinks) on\n"
"`threads` threads (those it starts run `nice` nicer than the caller, whose own priority\n"
"stays). `rules` is (key_min, key_max, temp_lead, temp_hex) (see\n"
"cachemgr.backends.ScanRules). `groups` is a list of (shape, kind, files, bytes, digest,\n"
"untracked, {size: files}) for the regular files, one per name shape (a leading\n"
"key_min..key_max-hex-digit key, or the temp_hex hex digits after a leading temp_lead,\n"
"replaced by '0's); `kind` is kind_of(shape), called once per shape with the GIL;\n"
"`digest` is the XOR of page_digest(name, size) over the group and `untracked` counts files\n"
"whose size was not among the first 1024 distinct ones. `other` counts entries that are not\n"
"regular files, `gone` those deleted between listing and stat, and `pages` the distinct keys\n"
"among the files of kind 1 (a page). With `levels` > 0 the files are that many dirs down,\n"
"through the subdirectories dir_ok(level, name: bytes) keeps (never a symlink); digests and\n"
"page keys are then of the paths below dir_fd, and with `threads` > 1 the subtrees of each\n"
"dir two levels above the files are walked on `threads` threads (same result).\n\n"
"`rows` = (conn, lib, sql, at, key_len_of): also run `sql` on the sqlite3 connection `conn`\n"
"(through the SQLite of `lib`, the sqlite3 module's extension) for each page file, bound to\n"
"(path below dir_fd, size, min(mtime, at), key length): key_len_of(shape) for a flat page,\n"
"the whole path's length for a nested one, 0 for a page without a key. NotImplementedError\n"
"before any walk if SQLite's calls cannot be found; a failed step stops the walk and is\n"
"raised as sqlite3 would (OperationalError, DatabaseError). The caller holds the\n"
"transaction.");

/* Parse (key_min, key_max, temp_lead, temp_hex) and lay out the shape prefixes; 0 on error. */
static int parse_rules(PyObject *arg, Rules *r) {
    int key_min, key_max, temp_hex, lead;
    if (!PyArg_ParseTuple(arg, "iiCi", &key_min, &key_max, &lead, &temp_hex))
        return 0;
    if (key_min < 1 || key_max < key_min || key_max > RULE_MAX ||
        temp_hex < 1 || temp_hex > RULE_MAX || lead < 1 || lead > 127) {
        PyErr_SetString(PyExc_ValueError, "scan rules out of range");
        return 0;
    }
    *r = (Rules){.key_min = (size_t)key_min, .key_max = (size_t)key_max,
                 .temp_hex = (size_t)temp_hex, .temp_lead = (char)lead};
    memset(r->prefix[PAGE_KEY], '0', r->key_max); /* a shape keeps its key's length */
    r->prefix[TEMP_KEY][0] = r->temp_lead;
    memset(r->prefix[TEMP_KEY] + 1, '0', r->temp_hex);
    return 1;
}

/* Raise SQLite's failure `rc` as the sqlite3 module would class it; NULL. */
static PyObject *sql_error(int rc, const char *msg) {
    PyObject *mod = PyImport_ImportModule("sqlite3");
    int primary = rc & 0xff;
    const char *name = primary == 11 || primary == 26 ? "DatabaseError" /* CORRUPT, NOTADB */
                       : primary == 19                ? "IntegrityError" /* CONSTRAINT */
                                                      : "OperationalError";
    PyObject *exc = mod ? PyObject_GetAttrString(mod, name) : NULL;
    if (exc)
        PyErr_SetString(exc, msg);
    Py_XDECREF(exc);
    Py_XDECREF(mod);
    return NULL;
}

/* Prepare `into` = (conn, lib, sql, at, key_len_of) for a walk that stores page rows: 0 with
 * an exception set (NotImplementedError: SQLite's calls are out of reach from here). */
static int rows_open(PyObject *into, Rows *r, Totals *tot) {
    PyObject *conn, *key_len_of;
    const char *lib, *sql;
    double at;
    if (!PyArg_ParseTuple(into, "OssdO", &conn, &lib, &sql, &at, &key_len_of))
        return 0;
    if (strcmp(Py_TYPE(conn)->tp_name, "sqlite3.Connection") != 0 || !find_sqlite(lib)) {
        PyErr_SetString(PyExc_NotImplementedError, "SQLite's calls are not reachable from C");
        return 0;
    }
    sqlite3 *db = ((Connection *)conn)->db;
    if (db == NULL) {
        PyErr_SetString(PyExc_ValueError, "the connection is closed");
        return 0;
    }
    int rc = sq.prepare(db, sql, -1, &r->stmt, NULL);
    if (rc != 0) {
        sql_error(rc, sq.errmsg(db));
        return 0;
    }
    pthread_mutex_init(&r->lock, NULL);
    r->at = at;
    tot->rows = r, tot->key_len_of = key_len_of;
    return 1;
}

static PyObject *scan(PyObject *Py_UNUSED(self), PyObject *args) {
    int dirfd, threads, levels = 0, nice = 0;
    PyObject *rules, *kind_of, *ok = Py_None, *into = Py_None;
    if (!PyArg_ParseTuple(args, "iiO!O|iOOi", &dirfd, &threads, &PyTuple_Type, &rules, &kind_of,
                          &levels, &ok, &into, &nice))
        return NULL;
    if (threads < 1 || threads > MAX_THREADS)
        return PyErr_Format(PyExc_ValueError, "threads must be 1..%d", MAX_THREADS);
    if (levels < 0 || levels > MAX_LEVELS || (levels && ok == Py_None))
        return PyErr_Format(PyExc_ValueError, "levels must be 0..%d, with dir_ok", MAX_LEVELS);
    Totals tot = {0}; /* 4 KiB of path: fine on this stack */
    Rows rows = {0};
    if (!parse_rules(rules, &tot.rules) || (into != Py_None && !rows_open(into, &rows, &tot)))
        return NULL;
    tot.threads = threads, tot.levels = levels, tot.kind_of = kind_of, tot.nice = nice;
    /* nested: the dirs just above the leaf dirs' parents (vLLM: a rank dir) are split */
    tot.split = threads > 1 && levels ? (levels > 1 ? levels - 2 : 0) : -1;
    tot.dir_ok = levels ? ok : NULL;
    tot.cur = malloc(CHUNK * sizeof *tot.cur);
    tot.next = malloc(CHUNK * sizeof *tot.next);
    tot.verdicts = levels ? calloc(VERDICTS, sizeof *tot.verdicts) : NULL; /* NULL: uncached */
    tot.save = PyEval_SaveThread();
    int fd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0); /* walk_tree() closes it; the caller keeps dirfd */
    if (fd < 0)
        tot.err = errno;
    else if (!tot.cur || !tot.next) {
        tot.err = ENOMEM;
        close(fd);
    } else {
        tot.mnt = mount_of(fd);
        /* a dup shares its offset: start at the top whatever it is, and leave it there */
        if (lseek(fd, 0, SEEK_SET) < 0) {
            tot.err = errno;
            close(fd);
        } else {
            walk_tree(fd, 0, &tot);
            lseek(dirfd, 0, SEEK_SET);
        }
    }
    PyEval_RestoreThread(tot.save);
    if (tot.rows) {
        sq.finalize(rows.stmt);
        pthread_mutex_destroy(&rows.lock);
    }
    for (int i = 0; i <= MAX_LEVELS; i++)
        free(tot.dents[i]);
    free(tot.cur);
    free(tot.next);
    free(tot.verdicts);
    free(tot.keys.slots);
    if (tot.err || tot.py_err) {
        groups_free(&tot.groups);
        if (tot.py_err)
            return NULL;
        if (rows.rc)
            return sql_error(rows.rc, rows.msg);
        errno = tot.err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list && i < tot.groups.cap; i++) {
        if (!tot.groups.slots[i])
            continue;
        PyObject *t = group_tuple(tot.groups.slots[i]);
        if (!t || PyList_Append(list, t) < 0)
            Py_CLEAR(list);
        Py_XDECREF(t);
    }
    groups_free(&tot.groups);
    if (!list)
        return NULL;
    return Py_BuildValue("(NLLn)", list, (long long)tot.other, (long long)tot.gone,
                         (Py_ssize_t)tot.keys.used);
}

PyDoc_STRVAR(digest_doc,
"page_digest(name, size) -> int\n\n"
"The signed 64-bit digest of one page (its file name and size), as scan() sums them.");

static PyObject *py_page_digest(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *name;
    long long size;
    if (!PyArg_ParseTuple(args, "O&L", PyUnicode_FSConverter, &name, &size))
        return NULL;
    uint64_t d =
        page_digest(FNV_SEED, PyBytes_AS_STRING(name), (size_t)PyBytes_GET_SIZE(name), size);
    Py_DECREF(name);
    return PyLong_FromLongLong((long long)(int64_t)d);
}

PyDoc_STRVAR(mount_doc,
"mount_id(fd) -> int\n\n"
"The id of the mount the open file `fd` is on (statx STATX_MNT_ID; 0 if unknown): two dirs\n"
"on one filesystem may still be on two mounts (a bind mount), which st_dev does not tell.");

static PyObject *py_mount_id(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    return PyLong_FromUnsignedLongLong(mount_of(fd));
}

PyDoc_STRVAR(birth_doc,
"birth_time(path) -> float | None\n\n"
"When the file at `path` (not followed if a link) was created, in seconds since the epoch\n"
"(statx STATX_BTIME); None if it is gone or the filesystem does not keep it. A file written\n"
"to a temp name and renamed keeps its inode's: the time its writer began writing it.");

static PyObject *py_birth_time(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *path;
    if (!PyArg_ParseTuple(args, "O&", PyUnicode_FSConverter, &path))
        return NULL;
    struct statx stx;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = statx(AT_FDCWD, PyBytes_AS_STRING(path), AT_SYMLINK_NOFOLLOW, STATX_BTIME, &stx);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (rc != 0 || !(stx.stx_mask & STATX_BTIME))
        Py_RETURN_NONE;
    return PyFloat_FromDouble((double)stx.stx_btime.tv_sec + stx.stx_btime.tv_nsec * 1e-9);
}

PyDoc_STRVAR(stat_files_doc,
"stat_files(root, files) -> list[tuple[int, float, float, float | None] | None]\n\n"
"(size, mtime, ctime, birth time) of each (dir, name) of `files` at `root`/dir/name (not\n"
"followed if a link), by statx; None for one that is gone (or its dir is); the birth time is\n"
"None where the filesystem keeps none. One call for a batch of the index's page events:\n"
"the GIL is let go once for all the stats, not twice a file (os.stat and birth_time each\n"
"give it up and wait to take it back behind the daemon's other threads). OSError for any\n"
"other failure, as os.stat.");

/* A file's path and what its statx said: errno 0 or the failure. */
typedef struct {
    PyObject *path; /* bytes */
    struct statx stx;
    int err;
} Stated;

static double stx_time(struct statx_timestamp t) {
    return (double)t.tv_sec + t.tv_nsec * 1e-9; /* as os.stat's st_mtime */
}

static PyObject *stated_tuple(const Stated *f) {
    const struct statx *x = &f->stx;
    if (f->err)
        Py_RETURN_NONE;
    if (x->stx_mask & STATX_BTIME)
        return Py_BuildValue("(Lddd)", (long long)x->stx_size, stx_time(x->stx_mtime),
                             stx_time(x->stx_ctime), stx_time(x->stx_btime));
    return Py_BuildValue("(LddO)", (long long)x->stx_size, stx_time(x->stx_mtime),
                         stx_time(x->stx_ctime), Py_None);
}

/* root/dir/name as bytes in the filesystem's encoding, as os.fsencode; NULL on an error. */
static PyObject *file_path(PyObject *root, PyObject *item) {
    PyObject *dir, *name;
    if (!PyArg_ParseTuple(item, "UU", &dir, &name))
        return NULL;
    PyObject *joined = PyUnicode_FromFormat("%U/%U/%U", root, dir, name);
    if (joined == NULL)
        return NULL;
    PyObject *path = PyUnicode_EncodeFSDefault(joined);
    Py_DECREF(joined);
    return path;
}

static PyObject *stat_files(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *root, *files;
    if (!PyArg_ParseTuple(args, "UO", &root, &files))
        return NULL;
    PyObject *seq = PySequence_Fast(files, "files must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Stated *all = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Stated));
    PyObject *out = NULL;
    if (all == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if ((all[i].path = file_path(root, PySequence_Fast_GET_ITEM(seq, i))) == NULL)
            goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned mask = STATX_BASIC_STATS | STATX_BTIME;
        int rc = statx(AT_FDCWD, PyBytes_AS_STRING(all[i].path), AT_SYMLINK_NOFOLLOW, mask,
                       &all[i].stx);
        all[i].err = rc == 0 ? 0 : errno;
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int err = all[i].err;
        if (err && err != ENOENT && err != ENOTDIR) {
            errno = err;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, all[i].path);
            goto done;
        }
    }
    if ((out = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = stated_tuple(&all[i]);
        if (t == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, t);
    }
done:
    if (all != NULL)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(all[i].path);
    PyMem_Free(all);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(pinned_doc,
"pinned(dir_fd, name) -> bool\n\n"
"Whether chattr +i or +a is set on `name` in `dir_fd` (\"\" for the dir itself): no one\n"
"unlinks it, or in it, root included. Read by statx, the file never opened (the daemon's\n"
"watcher takes an open and close for a read of the page); False where the filesystem\n"
"cannot say. OSError if it is gone.");

static PyObject *py_pinned(PyObject *Py_UNUSED(self), PyObject *args) {
    int fd;
    PyObject *name;
    if (!PyArg_ParseTuple(args, "iO&", &fd, PyUnicode_FSConverter, &name))
        return NULL;
    const char *path = PyBytes_AS_STRING(name);
    int flags = AT_SYMLINK_NOFOLLOW | AT_STATX_DONT_SYNC | (*path ? 0 : AT_EMPTY_PATH);
    struct statx stx;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = statx(fd, path, flags, STATX_TYPE, &stx);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
        Py_DECREF(name);
        return NULL;
    }
    Py_DECREF(name);
    const uint64_t pinning = STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND;
    return PyBool_FromLong((stx.stx_attributes & stx.stx_attributes_mask & pinning) != 0);
}

PyDoc_STRVAR(sql_functions_doc,
"sql_functions(conn, lib) -> bool\n\n"
"Register cachemgr_page_digest(name, size) and cachemgr_xor(a, b) in C on the sqlite3\n"
"connection `conn`, using the SQLite of `lib` (the sqlite3 module's extension file): a\n"
"trigger's call then never takes the GIL. False if `conn` is not a sqlite3.Connection or\n"
"SQLite's calls are not found there (then register the Python ones).");

static PyObject *sql_functions(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *conn;
    const char *lib;
    if (!PyArg_ParseTuple(args, "Os", &conn, &lib))
        return NULL;
    if (strcmp(Py_TYPE(conn)->tp_name, "sqlite3.Connection") != 0 || !find_sqlite(lib))
        Py_RETURN_FALSE;
    sqlite3 *db = ((Connection *)conn)->db;
    if (db == NULL)
        Py_RETURN_FALSE; /* closed */
    const int how = SQL_UTF8 | SQL_DETERMINISTIC;
    if (sq.create_function(db, "cachemgr_page_digest", 2, how, NULL, sql_page_digest, NULL, NULL,
                           NULL) != 0 ||
        sq.create_function(db, "cachemgr_xor", 2, how, NULL, sql_xor, NULL, NULL, NULL) != 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"birth_time", py_birth_time, METH_VARARGS, birth_doc},
    {"scan", scan, METH_VARARGS, scan_doc},
    {"mount_id", py_mount_id, METH_VARARGS, mount_doc},
    {"page_digest", py_page_digest, METH_VARARGS, digest_doc},
    {"pinned", py_pinned, METH_VARARGS, pinned_doc},
    {"stat_files", stat_files, METH_VARARGS, stat_files_doc},
    {"sql_functions", sql_functions, METH_VARARGS, sql_functions_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cachemgr.fs._dirscan",
    .m_doc = "List and stat a directory without the GIL (see _dirscan.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__dirscan(void) { return PyModule_Create(&module); }
