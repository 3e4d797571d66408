/* p2pnode._block_loops: the per-block loops of a simulated KV cache and of the simulator's gossip model in C.
 *
 * A simulated request walks its chain of block hashes a few times (its cached prefix at admission, its stored
 * blocks, its unpinning at the end) and every gossip round walks a node's summary changes; each walk is a Python loop
 * of a dict read and write per block, ~20% of a simulated request in all. Here each is one call. Every function is
 * the C twin of the Python function of the same name in p2pnode/block_loops.py, which stays the definition and the
 * fallback without a compiler; tests/unit/test_block_loops.py holds each to its Python over random inputs.
 *
 * Contract (Python ints throughout; ``refs`` and ``inverted`` are dicts; ``chain``, ``hashes``, ``keys``, ``changes``
 * and ``ids`` lists or tuples):
 *   cached_prefix(refs, chain, cap) -> (m, fresh)
 *     ``engine/simulated/kvcache.py``'s ``_prefix`` walk: m, how many leading items of chain[:cap] are keys of
 *     refs; fresh, a new list of those among them whose value is 0, in chain order.
 *   pin(refs, hashes)
 *     refs[h] += 1 for each h of a list (KeyError for one not in refs: the blocks before it stay counted).
 *   unpin(refs, chain, n) -> freed
 *     refs[h] -= 1 for each of chain[:n], last first; freed: a new list of those that reached 0, in that order
 *     (KeyError for one not in refs).
 *   store_scan(refs, chain, lo, hi) -> (new, dups, fresh, runs)
 *     ``PagedPrefixCache.store``'s walk of chain[lo:hi]: a hash not in refs gets 1 and goes to new; one in refs is
 *     counted once more and goes to dups (and to fresh if it was 0); runs: a flat list [start, end, ...] of the
 *     half-open index ranges of consecutive new hashes, in order.
 *   set_none(mapping, keys) / delete_keys(mapping, keys)
 *     mapping[k] = None / del mapping[k] for each k of an iterable, in order (an OrderedDict's order is the point:
 *     ``cache/eviction/lru.py``); KeyError from a delete stops there.
 *   apply_journal(inverted, bit, changes)
 *     One node's summary changes into the gossip model's inverted index: for each entry, h >= 0 sets ``bit`` in
 *     inverted[h]; ~h (< 0) clears it and drops the key once its mask is 0.
 *   prefix_depths(hashes, inverted, ids) -> dict | NotImplemented
 *     ``prefix_depths_by`` with ``inverted.get`` as the mask reader: {ids[k]: how many leading hashes node k holds}
 *     for the nodes holding at least one, in the Python's insertion order; NotImplemented for more than 64 ids or a
 *     mask that is not a non-negative int below 2**64 or names a node past ``ids`` (the Python answers then).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *ZERO;  /* the int 0 */

static int
check_dict(PyObject *obj, const char *what)
{
    if (!PyDict_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

/* A list's or tuple's items (borrowed; valid while it is not resized: ints compared in a dict never resize it). */
static int
seq_items(PyObject *obj, const char *what, PyObject *const **items, Py_ssize_t *n)
{
    if (!PyList_Check(obj) && !PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list or tuple, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *items = PySequence_Fast_ITEMS(obj);
    *n = PySequence_Fast_GET_SIZE(obj);
    return 0;
}

/* ``refs`` (a dict) and ``chain`` (a list or tuple): the first two arguments of every walk over a chain. */
static int
refs_and_chain(PyObject *const *args, PyObject **refs, PyObject *const **chain, Py_ssize_t *len)
{
    *refs = args[0];
    return check_dict(*refs, "refs") < 0 || seq_items(args[1], "chain", chain, len) < 0 ? -1 : 0;
}

/* An index argument; -1 with an error set when it is not an int. */
static inline int
index_of(PyObject *obj, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(obj);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The int value of a pin count (refs' values are small ints); -1 with an error set. */
static inline long
count_of(PyObject *value)
{
    long c = PyLong_AsLong(value);
    if (c == -1 && PyErr_Occurred()) {
        return -1;
    }
    return c;
}

/* cached_prefix (module docstring). */
static PyObject *
cached_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "cached_prefix(refs, chain, cap) takes 3 arguments");
        return NULL;
    }
    PyObject *refs;
    PyObject *const *chain;
    Py_ssize_t len, cap;
    if (refs_and_chain(args, &refs, &chain, &len) < 0 || index_of(args[2], &cap) < 0) {
        return NULL;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL) {
        return NULL;
    }
    Py_ssize_t m = 0;
    while (m < cap) {
        if (m >= len) {
            PyErr_SetString(PyExc_IndexError, "chain index out of range");
            goto error;
        }
        PyObject *h = chain[m];
        PyObject *c = PyDict_GetItemWithError(refs, h);  /* borrowed */
        if (c == NULL) {
            if (PyErr_Occurred()) {
                goto error;
            }
            break;
        }
        long count = count_of(c);
        if (count == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (count == 0 && PyList_Append(fresh, h) < 0) {
            goto error;
        }
        m++;
    }
    PyObject *result = Py_BuildValue("(nN)", m, fresh);
    return result;
error:
    Py_DECREF(fresh);
    return NULL;
}

/* refs[h] += delta for one h; the new count, or -1 with an error set (KeyError when h is not a key). */
static long
add_to(PyObject *refs, PyObject *h, long delta)
{
    PyObject *c = PyDict_GetItemWithError(refs, h);  /* borrowed */
    if (c == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, h);
        }
        return -1;
    }
    long count = count_of(c);
    if (count == -1 && PyErr_Occurred()) {
        return -1;
    }
    count += delta;
    PyObject *value = PyLong_FromLong(count);
    if (value == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(refs, h, value);
    Py_DECREF(value);
    if (rc < 0) {
        return -1;
    }
    return count;
}

/* pin (module docstring). */
static PyObject *
pin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pin(refs, hashes) takes 2 arguments");
        return NULL;
    }
    PyObject *refs = args[0];
    PyObject *const *hashes;
    Py_ssize_t n;
    if (check_dict(refs, "refs") < 0 || seq_items(args[1], "hashes", &hashes, &n) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (add_to(refs, hashes[i], 1) == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* unpin (module docstring). */
static PyObject *
unpin(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unpin(refs, chain, n) takes 3 arguments");
        return NULL;
    }
    PyObject *refs;
    PyObject *const *chain;
    Py_ssize_t len, n;
    if (refs_and_chain(args, &refs, &chain, &len) < 0 || index_of(args[2], &n) < 0) {
        return NULL;
    }
    if (n < 0) {  /* chain[:n], as a slice reads it */
        n = n + len < 0 ? 0 : n + len;
    }
    else if (n > len) {
        n = len;
    }
    PyObject *freed = PyList_New(0);
    if (freed == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *h = chain[i];
        Py_INCREF(h);
        long count = add_to(refs, h, -1);
        if (count == -1 && PyErr_Occurred()) {
            Py_DECREF(h);
            Py_DECREF(freed);
            return NULL;
        }
        if (count == 0 && PyList_Append(freed, h) < 0) {
            Py_DECREF(h);
            Py_DECREF(freed);
            return NULL;
        }
        Py_DECREF(h);
    }
    return freed;
}

/* ``start, end`` appended to ``runs``; -1 with an error set. */
static int
append_run(PyObject *runs, Py_ssize_t start, Py_ssize_t end)
{
    PyObject *a = PyLong_FromSsize_t(start), *b = PyLong_FromSsize_t(end);
    int bad = a == NULL || b == NULL || PyList_Append(runs, a) < 0 || PyList_Append(runs, b) < 0;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return bad ? -1 : 0;
}

/* store_scan (module docstring). */
static PyObject *
store_scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "store_scan(refs, chain, lo, hi) takes 4 arguments");
        return NULL;
    }
    PyObject *refs;
    PyObject *const *chain;
    Py_ssize_t len, lo, hi;
    if (refs_and_chain(args, &refs, &chain, &len) < 0 || index_of(args[2], &lo) < 0 || index_of(args[3], &hi) < 0) {
        return NULL;
    }
    PyObject *new = PyList_New(0), *dups = PyList_New(0), *fresh = PyList_New(0), *runs = PyList_New(0);
    PyObject *one = PyLong_FromLong(1);
    if (new == NULL || dups == NULL || fresh == NULL || runs == NULL || one == NULL) {
        goto error;
    }
    Py_ssize_t run_start = -1;
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i < 0 || i >= len) {
            PyErr_SetString(PyExc_IndexError, "chain index out of range");
            goto error;
        }
        PyObject *h = chain[i];
        PyObject *c = PyDict_GetItemWithError(refs, h);  /* borrowed */
        if (c == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(refs, h, one) < 0 || PyList_Append(new, h) < 0) {
                goto error;
            }
            if (run_start < 0) {
                run_start = i;
            }
            continue;
        }
        long count = count_of(c);
        if (count == -1 && PyErr_Occurred()) {
            goto error;
        }
        PyObject *value = PyLong_FromLong(count + 1);
        if (value == NULL) {
            goto error;
        }
        int rc = PyDict_SetItem(refs, h, value);
        Py_DECREF(value);
        if (rc < 0 || PyList_Append(dups, h) < 0 || (count == 0 && PyList_Append(fresh, h) < 0)) {
            goto error;
        }
        if (run_start >= 0) {
            if (append_run(runs, run_start, i) < 0) {
                goto error;
            }
            run_start = -1;
        }
    }
    if (run_start >= 0 && append_run(runs, run_start, hi) < 0) {
        goto error;
    }
    Py_DECREF(one);
    return Py_BuildValue("(NNNN)", new, dups, fresh, runs);
error:
    Py_XDECREF(new);
    Py_XDECREF(dups);
    Py_XDECREF(fresh);
    Py_XDECREF(runs);
    Py_XDECREF(one);
    return NULL;
}

/* mapping[k] = None (``delete`` 0) or del mapping[k] (1) for each key of args[1], in order: set_none and
 * delete_keys. */
static PyObject *
for_each_key(PyObject *const *args, Py_ssize_t nargs, const char *usage, int delete)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments", usage);
        return NULL;
    }
    PyObject *mapping = args[0];
    PyObject *seq = PySequence_Fast(args[1], "keys must be iterable");  /* a list or tuple as it is */
    if (seq == NULL) {
        return NULL;
    }
    PyObject *const *keys = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = delete ? PyObject_DelItem(mapping, keys[i]) : PyObject_SetItem(mapping, keys[i], Py_None);
        if (rc < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* set_none (module docstring). */
static PyObject *
set_none(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_key(args, nargs, "set_none(mapping, keys)", 0);
}

/* delete_keys (module docstring). */
static PyObject *
delete_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_key(args, nargs, "delete_keys(mapping, keys)", 1);
}

/* apply_journal (module docstring). */
static PyObject *
apply_journal(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "apply_journal(inverted, bit, changes) takes 3 arguments");
        return NULL;
    }
    PyObject *inv = args[0], *bit = args[1];
    PyObject *const *changes;
    Py_ssize_t n;
    if (check_dict(inv, "inverted") < 0 || seq_items(args[2], "changes", &changes, &n) < 0) {
        return NULL;
    }
    PyObject *clear = PyNumber_Invert(bit);
    if (clear == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = changes[i];
        int negative = PyObject_RichCompareBool(entry, ZERO, Py_LT);
        if (negative < 0) {
            goto error;
        }
        if (!negative) {
            PyObject *m = PyDict_GetItemWithError(inv, entry);  /* borrowed */
            if (m == NULL && PyErr_Occurred()) {
                goto error;
            }
            PyObject *value = PyNumber_Or(m != NULL ? m : ZERO, bit);
            if (value == NULL) {
                goto error;
            }
            int rc = PyDict_SetItem(inv, entry, value);
            Py_DECREF(value);
            if (rc < 0) {
                goto error;
            }
            continue;
        }
        PyObject *h = PyNumber_Invert(entry);
        if (h == NULL) {
            goto error;
        }
        PyObject *m = PyDict_GetItemWithError(inv, h);  /* borrowed */
        if (m == NULL && PyErr_Occurred()) {
            Py_DECREF(h);
            goto error;
        }
        PyObject *value = PyNumber_And(m != NULL ? m : ZERO, clear);
        if (value == NULL) {
            Py_DECREF(h);
            goto error;
        }
        int truth = PyObject_IsTrue(value);
        int rc;
        if (truth < 0) {
            rc = -1;
        }
        else if (truth) {
            rc = PyDict_SetItem(inv, h, value);
        }
        else if (m != NULL) {
            rc = PyDict_DelItem(inv, h);
        }
        else {
            rc = 0;
        }
        Py_DECREF(value);
        Py_DECREF(h);
        if (rc < 0) {
            goto error;
        }
    }
    Py_DECREF(clear);
    Py_RETURN_NONE;
error:
    Py_DECREF(clear);
    return NULL;
}

/* A mask read as 64 bits; 0 when it is not a non-negative int below 2**64 (the caller answers NotImplemented). */
static inline int
mask_bits(PyObject *m, uint64_t *out)
{
    if (!PyLong_CheckExact(m)) {
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(m);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

/* The ids at the set bits of ``bits``, lowest first, each given ``depth`` in ``out``; -1 with an error set. */
static int
write_depths(PyObject *out, PyObject *const *ids, uint64_t bits, Py_ssize_t depth)
{
    if (bits == 0) {
        return 0;
    }
    PyObject *value = PyLong_FromSsize_t(depth);
    if (value == NULL) {
        return -1;
    }
    while (bits) {
        int k = __builtin_ctzll(bits);
        bits &= bits - 1;
        if (PyDict_SetItem(out, ids[k], value) < 0) {
            Py_DECREF(value);
            return -1;
        }
    }
    Py_DECREF(value);
    return 0;
}

/* prefix_depths (module docstring). */
static PyObject *
prefix_depths(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prefix_depths(hashes, inverted, ids) takes 3 arguments");
        return NULL;
    }
    PyObject *inv = args[1];
    PyObject *const *items, *const *ids;
    Py_ssize_t n, n_ids;
    if (seq_items(args[0], "hashes", &items, &n) < 0 || check_dict(inv, "inverted") < 0
        || seq_items(args[2], "ids", &ids, &n_ids) < 0) {
        return NULL;
    }
    if (n_ids > 64) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    uint64_t alive = n_ids == 64 ? ~(uint64_t)0 : (((uint64_t)1 << n_ids) - 1);
    /* A mask past 64 bits or naming a node past ``ids`` is the Python's to answer (the dict made so far dropped). */
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *m = PyDict_GetItemWithError(inv, items[i]);  /* borrowed */
        uint64_t bits = 0;
        if (m == NULL) {
            if (PyErr_Occurred()) {
                goto error;
            }
        }
        else if (!mask_bits(m, &bits) || (n_ids < 64 && (bits >> n_ids) != 0)) {
            Py_DECREF(out);
            Py_RETURN_NOTIMPLEMENTED;
        }
        uint64_t lost = alive & ~bits;
        if (lost) {
            if (i && write_depths(out, ids, lost, i) < 0) {
                goto error;
            }
            alive &= bits;
            if (!alive) {
                return out;
            }
        }
    }
    if (i && write_depths(out, ids, alive, i) < 0) {
        goto error;
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"cached_prefix", (PyCFunction)(void (*)(void))cached_prefix, METH_FASTCALL,
     "cached_prefix(refs, chain, cap) -> (leading items of chain[:cap] in refs, those of them whose count is 0)"},
    {"pin", (PyCFunction)(void (*)(void))pin, METH_FASTCALL, "pin(refs, hashes): refs[h] += 1 for each h"},
    {"unpin", (PyCFunction)(void (*)(void))unpin, METH_FASTCALL,
     "unpin(refs, chain, n) -> refs[h] -= 1 for chain[:n] last first; those that reached 0, in that order"},
    {"store_scan", (PyCFunction)(void (*)(void))store_scan, METH_FASTCALL,
     "store_scan(refs, chain, lo, hi) -> (new, dups, fresh, runs of new as a flat [start, end, ...])"},
    {"set_none", (PyCFunction)(void (*)(void))set_none, METH_FASTCALL,
     "set_none(mapping, keys): mapping[k] = None for each k, in order"},
    {"delete_keys", (PyCFunction)(void (*)(void))delete_keys, METH_FASTCALL,
     "delete_keys(mapping, keys): del mapping[k] for each k, in order"},
    {"apply_journal", (PyCFunction)(void (*)(void))apply_journal, METH_FASTCALL,
     "apply_journal(inverted, bit, changes): a hash sets bit in its mask, ~hash clears it (0: the key goes)"},
    {"prefix_depths", (PyCFunction)(void (*)(void))prefix_depths, METH_FASTCALL,
     "prefix_depths(hashes, inverted, ids) -> {id: leading hashes its bit holds}, or NotImplemented past 64 ids"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_block_loops",
    "The per-block loops of a simulated KV cache and of the simulator's gossip model in C (see block_loops.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__block_loops(void)
{
    ZERO = PyLong_FromLong(0);
    if (ZERO == NULL) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
