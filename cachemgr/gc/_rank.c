/* cachemgr.gc._rank: the eviction order's pass over pages no chain links (cachemgr.gc.value),
 * in C, without the GIL.
 *
 * Why C: after a scan (a restarted daemon, an adopted dir) every page is a segment of its own,
 * and at 10M pages valuing and heaping each one in Python took ~33 s before GC's first unlink,
 * with ~1.5 GB of tuples, every bytecode of it competing for the GIL with a /metrics scrape.
 * Here they are split from the chained leaves, counted into the prior's sums, valued and sorted
 * in a few passes over the model's columns (typed arrays, read through the buffer protocol),
 * ~40 bytes a page while the order lasts. The caller holds the chain model's lock: nothing
 * writes the columns meanwhile, so the GIL is let go during the passes.
 *
 * Each value is the one cachemgr.gc.returns.worth gives, computed with the same operations in
 * the same order in doubles (no contraction into fused multiply-adds: -ffp-contract=off), so
 * that the order is the one the Python path gave, ties included.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NONE (-1)
#define END 0.05 /* cachemgr.gc.returns.END */

/* A column: an array of any of the integer typecodes the page store widens through, or 'd'. */
typedef struct {
    Py_buffer view;
    char code;
} Col;

/* The item size of a native typecode (what array.array exports). */
static Py_ssize_t size_of(char code) {
    switch (code) {
    case 'b': case 'B': return 1;
    case 'h': case 'H': return sizeof(short);
    case 'i': case 'I': return sizeof(int);
    case 'l': case 'L': return sizeof(long);
    case 'q': case 'Q': return sizeof(long long);
    default: return sizeof(double);
    }
}

static int col_open(PyObject *obj, Col *c, const char *name) {
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_FORMAT | PyBUF_ND) != 0)
        return -1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '@')
        f++;
    c->code = *f;
    if (!strchr("bBhHiIlLqQd", c->code) || f[1] != '\0' || c->view.itemsize != size_of(c->code)) {
        PyErr_Format(PyExc_TypeError, "%s: an array of numbers is needed, not '%s'", name, f);
        PyBuffer_Release(&c->view);
        return -1;
    }
    return 0;
}

static void col_close(Col *c) {
    if (c->view.obj)
        PyBuffer_Release(&c->view);
}

static inline long long col_int(const Col *c, Py_ssize_t i) {
    const void *b = c->view.buf;
    switch (c->code) {
    case 'b': return ((const signed char *)b)[i];
    case 'B': return ((const unsigned char *)b)[i];
    case 'h': return ((const short *)b)[i];
    case 'H': return ((const unsigned short *)b)[i];
    case 'i': return ((const int *)b)[i];
    case 'I': return ((const unsigned int *)b)[i];
    case 'l': return ((const long *)b)[i];
    case 'L': return (long long)((const unsigned long *)b)[i];
    case 'q': return ((const long long *)b)[i];
    case 'Q': return (long long)((const unsigned long long *)b)[i];
    default: return (long long)((const double *)b)[i];
    }
}

static inline double col_double(const Col *c, Py_ssize_t i) {
    return c->code == 'd' ? ((const double *)c->view.buf)[i] : (double)col_int(c, i);
}

static inline Py_ssize_t col_len(const Col *c) { return c->view.len / c->view.itemsize; }

/* An int32 buffer (slots or positions): bytes, or an array('i'). */
typedef struct {
    Py_buffer view;
    const int32_t *v;
    Py_ssize_t n;
} Ints;

static int ints_open(PyObject *obj, Ints *x, const char *name) {
    if (PyObject_GetBuffer(obj, &x->view, PyBUF_SIMPLE) != 0)
        return -1;
    if (x->view.len % 4) {
        PyErr_Format(PyExc_ValueError, "%s: int32 items are needed", name);
        PyBuffer_Release(&x->view);
        return -1;
    }
    x->v = (const int32_t *)x->view.buf;
    x->n = x->view.len / 4;
    return 0;
}

static void ints_close(Ints *x) {
    if (x->view.obj)
        PyBuffer_Release(&x->view);
}

static int held_has(const Ints *held, int32_t s) {
    Py_ssize_t lo = 0, hi = held->n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (held->v[mid] < s)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < held->n && held->v[lo] == s;
}

/* Whether every slot in `leaves` (or, with `at`, every slot at those positions of `leaves`)
 * is in each of the k columns; IndexError if not. */
static int in_columns(const Ints *leaves, const Ints *at, const Col *const *cols, int k) {
    Py_ssize_t top = PY_SSIZE_T_MAX;
    for (int i = 0; i < k; i++)
        top = col_len(cols[i]) < top ? col_len(cols[i]) : top;
    Py_ssize_t n = at ? at->n : leaves->n;
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t p = at ? at->v[j] : (int32_t)j;
        if (p < 0 || p >= leaves->n || leaves->v[p] < 0 || leaves->v[p] >= top) {
            PyErr_Format(PyExc_IndexError, "leaves[%d]: no such slot", (int)p);
            return 0;
        }
    }
    return 1;
}

/* A 128-bit sum as a Python int (the prior's sums are Python ints: exact). */
static PyObject *int128(__int128 x) {
    int neg = x < 0;
    unsigned __int128 u = neg ? -(unsigned __int128)x : (unsigned __int128)x;
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(u >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)u);
    PyObject *sixty_four = PyLong_FromLong(64), *shifted = NULL, *sum = NULL, *out = NULL;
    if (hi && lo && sixty_four && (shifted = PyNumber_Lshift(hi, sixty_four)) &&
        (sum = PyNumber_Or(shifted, lo)))
        out = neg ? PyNumber_Negative(sum) : (Py_INCREF(sum), sum);
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(sixty_four);
    Py_XDECREF(shifted);
    Py_XDECREF(sum);
    return out;
}

static PyObject *bytes_of(const int32_t *v, Py_ssize_t n) {
    return PyBytes_FromStringAndSize((const char *)v, n * 4);
}

PyDoc_STRVAR(leaf_slots_doc,
             "leaf_slots(leaf, ns, wanted, /) -> bytes\n\n"
             "The slots whose byte in `leaf` is 1, in slot order, as int32 items; with `wanted`\n"
             "(a byte per namespace number, 1: wanted), only those of wanted namespaces.");

static PyObject *leaf_slots(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *leaf_obj, *ns_obj, *wanted_obj;
    if (!PyArg_ParseTuple(args, "OOO:leaf_slots", &leaf_obj, &ns_obj, &wanted_obj))
        return NULL;
    Py_buffer leaf = {0}, wanted = {0};
    Col ns = {0};
    PyObject *out = NULL;
    int32_t *slots = NULL;
    if (PyObject_GetBuffer(leaf_obj, &leaf, PyBUF_SIMPLE) != 0)
        return NULL;
    if (col_open(ns_obj, &ns, "ns") != 0)
        goto done;
    if (wanted_obj != Py_None && PyObject_GetBuffer(wanted_obj, &wanted, PyBUF_SIMPLE) != 0)
        goto done;
    Py_ssize_t n = leaf.len < col_len(&ns) ? leaf.len : col_len(&ns), k = 0;
    slots = PyMem_RawMalloc((n ? n : 1) * sizeof(int32_t));
    if (!slots) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *flag = leaf.buf, *want = wanted.buf;
    Py_ssize_t nwant = wanted.len;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t s = 0; s < n; s++) {
        if (!flag[s])
            continue;
        if (want) {
            long long num = col_int(&ns, s);
            if (num < 0 || num >= nwant || !want[num])
                continue;
        }
        slots[k++] = (int32_t)s;
    }
    Py_END_ALLOW_THREADS
    out = bytes_of(slots, k);
done:
    PyMem_RawFree(slots);
    PyBuffer_Release(&leaf);
    if (wanted.obj)
        PyBuffer_Release(&wanted);
    col_close(&ns);
    return out;
}

PyDoc_STRVAR(split_doc,
             "split(leaves, pred, time, before, held, reads, born, clock, /)\n"
             "    -> (one, chained, sums)\n\n"
             "The positions in `leaves` (int32 slots) of the leaves no page precedes (`pred` is\n"
             "-1) that may go (`time` at most `before`, the slot not in `held`, sorted int32),\n"
             "and of the others, each as int32 bytes in leaf order; the first ones' sums of\n"
             "(c, e, c*c, c*e, e*e) for c = reads, e = max(clock - born, 0)\n"
             "(cachemgr.gc.returns.Moments).");

static PyObject *split(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *leaves_obj, *pred_obj, *time_obj, *held_obj, *reads_obj, *born_obj;
    double before;
    long long clock;
    if (!PyArg_ParseTuple(args, "OOOdOOOL:split", &leaves_obj, &pred_obj, &time_obj, &before,
                          &held_obj, &reads_obj, &born_obj, &clock))
        return NULL;
    Ints leaves = {0}, held = {0};
    Col pred = {0}, time = {0}, reads = {0}, born = {0};
    int32_t *one = NULL, *chained = NULL;
    PyObject *out = NULL;
    if (ints_open(leaves_obj, &leaves, "leaves") || col_open(pred_obj, &pred, "pred") ||
        col_open(time_obj, &time, "time") || ints_open(held_obj, &held, "held") ||
        col_open(reads_obj, &reads, "reads") || col_open(born_obj, &born, "born"))
        goto done;
    Py_ssize_t n = leaves.n;
    if (!in_columns(&leaves, NULL, (const Col *[]){&pred, &time, &reads, &born}, 4))
        goto done;
    one = PyMem_RawMalloc((n ? n : 1) * sizeof(int32_t));
    chained = PyMem_RawMalloc((n ? n : 1) * sizeof(int32_t));
    if (!one || !chained) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k1 = 0, k2 = 0;
    __int128 c = 0, e = 0, cc = 0, ce = 0, ee = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t s = leaves.v[j];
        if (col_int(&pred, s) != NONE) {
            chained[k2++] = (int32_t)j;
            continue;
        }
        if (!(col_double(&time, s) <= before) || held_has(&held, s))
            continue;
        one[k1++] = (int32_t)j;
        long long r = col_int(&reads, s), x = clock - col_int(&born, s);
        if (x < 0)
            x = 0;
        c += r;
        e += x;
        cc += (__int128)r * r;
        ce += (__int128)r * x;
        ee += (__int128)x * x;
    }
    Py_END_ALLOW_THREADS
    PyObject *sums[5] = {int128(c), int128(e), int128(cc), int128(ce), int128(ee)};
    PyObject *b1 = bytes_of(one, k1), *b2 = bytes_of(chained, k2);
    if (sums[0] && sums[1] && sums[2] && sums[3] && sums[4] && b1 && b2)
        out = Py_BuildValue("(OO(OOOOO))", b1, b2, sums[0], sums[1], sums[2], sums[3], sums[4]);
    for (int i = 0; i < 5; i++)
        Py_XDECREF(sums[i]);
    Py_XDECREF(b1);
    Py_XDECREF(b2);
done:
    PyMem_RawFree(one);
    PyMem_RawFree(chained);
    ints_close(&leaves);
    ints_close(&held);
    col_close(&pred);
    col_close(&time);
    col_close(&reads);
    col_close(&born);
    return out;
}

/* A segment's sort key: (key in the order followed, its latest use, that use's wall clock);
 * ties go by position in leaf order. */
typedef struct {
    double key, last, when;
} Key;

static int by_key(const void *pa, const void *pb, void *keys) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    const Key *x = (const Key *)keys + a, *y = (const Key *)keys + b;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    if (x->last != y->last)
        return x->last < y->last ? -1 : 1;
    if (x->when != y->when)
        return x->when < y->when ? -1 : 1;
    return (a > b) - (a < b);
}

/* cachemgr.gc.returns.worth, operation for operation. */
static double worth(double shape, double rate, long long returns, long long span,
                    long long silence) {
    double a = shape + (double)returns, b = rate + (double)span;
    double quiet = exp(-a * log1p((double)silence / b));
    double alive = quiet / (quiet + END * (1.0 - quiet));
    return (1.0 - END) * alive * a / (b + (double)silence);
}

PyDoc_STRVAR(rank_doc,
             "rank(one, leaves, reads, born, last, time, clock, trial_end, mode, shape, rate, /)\n"
             "    -> (keys, ranked)\n\n"
             "Value each one-page segment at `one` (positions in `leaves`, from `split`) as\n"
             "cachemgr.gc.value does: `mode` 0 its worth under the prior (shape, rate), 1 none\n"
             "(recency alone), 2 its worth, or -0.5 if unread since stored before `trial_end`.\n"
             "ValueError if a worth is not finite (a clock behind a page's use: Python's math\n"
             "raises there too).\n"
             "`keys`: (key, last, when) as three doubles an item of `one`; `ranked`: the items'\n"
             "indices (int32), lowest (key, last, when) first, ties in leaf order.");

static PyObject *rank(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *one_obj, *leaves_obj, *reads_obj, *born_obj, *last_obj, *time_obj;
    long long clock;
    double trial_end, shape, rate;
    int mode;
    if (!PyArg_ParseTuple(args, "OOOOOOLdidd:rank", &one_obj, &leaves_obj, &reads_obj, &born_obj,
                          &last_obj, &time_obj, &clock, &trial_end, &mode, &shape, &rate))
        return NULL;
    if (mode < 0 || mode > 2) {
        PyErr_Format(PyExc_ValueError, "mode %d: 0, 1 or 2", mode);
        return NULL;
    }
    Ints one = {0}, leaves = {0};
    Col reads = {0}, born = {0}, last = {0}, time = {0};
    PyObject *keys_obj = NULL, *ranked_obj = NULL, *out = NULL;
    if (ints_open(one_obj, &one, "one") || ints_open(leaves_obj, &leaves, "leaves") ||
        col_open(reads_obj, &reads, "reads") || col_open(born_obj, &born, "born") ||
        col_open(last_obj, &last, "last") || col_open(time_obj, &time, "time"))
        goto done;
    Py_ssize_t n = one.n;
    if (!in_columns(&leaves, &one, (const Col *[]){&reads, &born, &last, &time}, 4))
        goto done;
    keys_obj = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(Key));
    ranked_obj = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!keys_obj || !ranked_obj)
        goto done;
    Key *keys = (Key *)PyBytes_AS_STRING(keys_obj);
    int32_t *ranked = (int32_t *)PyBytes_AS_STRING(ranked_obj);
    int finite = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t s = leaves.v[one.v[j]];
        long long r = col_int(&reads, s), l = col_int(&last, s), b = col_int(&born, s);
        double key = 0.0;
        if (mode != 1) {
            key = worth(shape, rate, r, l - b > 0 ? l - b : 0, clock - l);
            finite &= isfinite(key) != 0;
            if (mode == 2 && r == 0 && (double)l < trial_end)
                key = -0.5;
        }
        keys[j] = (Key){key, (double)l, col_double(&time, s)};
        ranked[j] = (int32_t)j;
    }
    if (finite) /* (a NaN key would leave the comparison no order: no sort at all) */
        qsort_r(ranked, (size_t)n, sizeof(int32_t), by_key, keys); /* (glibc's: a merge sort) */
    Py_END_ALLOW_THREADS
    if (!finite) {
        PyErr_SetString(PyExc_ValueError, "math domain error: a page used after the clock");
        goto done;
    }
    out = PyTuple_Pack(2, keys_obj, ranked_obj);
done:
    Py_XDECREF(keys_obj);
    Py_XDECREF(ranked_obj);
    ints_close(&one);
    ints_close(&leaves);
    col_close(&reads);
    col_close(&born);
    col_close(&last);
    col_close(&time);
    return out;
}

static PyMethodDef methods[] = {
    {"leaf_slots", leaf_slots, METH_VARARGS, leaf_slots_doc},
    {"split", split, METH_VARARGS, split_doc},
    {"rank", rank, METH_VARARGS, rank_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cachemgr.gc._rank",
    .m_doc = "The eviction order's pass over one-page segments, without the GIL.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__rank(void) { return PyModule_Create(&module); }
