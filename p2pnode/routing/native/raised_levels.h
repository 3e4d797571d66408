/* raised_levels: routing/estimates.py's ``raised_levels`` in C (included by p2p_rank.c; the Python is the definition,
 * tests/unit/test_routing_levels.py holds this one to it).
 *
 *   raised_levels(levels, raised, left, cuts, cut_above) -> list | None | NotImplemented
 *
 * Why: a busy ingress's speculative index raises a few peers on most decisions, and the Python spent ~5 us moving
 * them (a dict of the levels' positions, a sorted set of depths, a tuple per level touched) -- at 64 peers a sixth of
 * the decision. Here the levels' depths are read once into an array and each touched level is found by bisection.
 *
 * The same answer as the definition -- the list, each level touched a new ``(depth, ids)`` tuple, the others the
 * caller's own -- or None where it gives None; ``cuts.moved`` is called as the definition calls it (for a level of more
 * than ``cut_above`` ids, with the sorted ids left and let in), its errors raised. NotImplemented, before anything is
 * called, off the common path (the caller then runs the Python): levels that are not a list of ``(int, tuple)`` with
 * depths strictly falling; ``raised`` not a dict of str -> int, ``left`` not a dict of int -> list of str; a level's
 * id that is not a str where a left peer is looked for (found after a ``cuts.moved`` call, the Python runs again: the
 * cuts remember their answer); an int past what p2p_rank.c's readers take (``read_int``: +-2**50 for the raised and
 * left depths and ``cut_above``; ``read_level``: a Py_ssize_t for a level's).
 */

/* A depth and what is there: a raised id's index in the dict's order, or a left group's list. */
typedef struct {
    long long depth;
    Py_ssize_t index;
    PyObject *obj; /* raised: the id; left: the list of ids (references held: ``cuts.moved`` runs Python) */
} rl_item;

/* By depth, then index: the raised ids grouped by depth, each group in the dict's order (the definition's joining). */
static int
rl_cmp(const void *a, const void *b)
{
    const rl_item *x = a, *y = b;
    if (x->depth != y->depth) {
        return (x->depth > y->depth) - (x->depth < y->depth);
    }
    return (x->index > y->index) - (x->index < y->index);
}

/* The ids of ``list`` (exact strs) as a sorted tuple: ``tuple(sorted(ids))``. */
static PyObject *
rl_sorted_tuple(PyObject *const *ids, Py_ssize_t n)
{
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(ids[i]);
        PyList_SET_ITEM(list, i, ids[i]);
    }
    PyObject *out = PyList_Sort(list) < 0 ? NULL : PyList_AsTuple(list);
    Py_DECREF(list);
    return out;
}

/* ``ids`` (a tuple) less ``gone`` (each removed at its first equal id), then ``joined``: a new tuple; Py_None
 * (borrowed) where ``ids`` lacks one of ``gone``; NotImplemented (borrowed) where an id read is not a str. */
static PyObject *
rl_cut(PyObject *ids, PyObject *const *gone, Py_ssize_t n_gone, PyObject *const *joined, Py_ssize_t n_joined)
{
    Py_ssize_t n = PyTuple_GET_SIZE(ids);
    PyObject **kept = PyMem_Malloc((size_t)(n + n_joined + 1) * sizeof(PyObject *));
    if (kept == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t k = n;
    memcpy(kept, &PyTuple_GET_ITEM(ids, 0), (size_t)n * sizeof(PyObject *));
    PyObject *out = NULL;
    for (Py_ssize_t g = 0; g < n_gone; g++) {
        Py_ssize_t at = 0;
        while (at < k && kept[at] != gone[g]) { /* the same object first (the directory's ids), then by value */
            at++;
        }
        if (at == k) {
            for (at = 0; at < k; at++) {
                if (!PyUnicode_CheckExact(kept[at])) {
                    out = Py_NotImplemented;
                    goto done;
                }
                if (PyUnicode_Compare(kept[at], gone[g]) == 0) {
                    break;
                }
            }
        }
        if (at == k) {
            out = Py_None; /* not where its estimate says */
            goto done;
        }
        memmove(kept + at, kept + at + 1, (size_t)(k - at - 1) * sizeof(PyObject *));
        k--;
    }
    memcpy(kept + k, joined, (size_t)n_joined * sizeof(PyObject *));
    out = PyTuple_New(k + n_joined);
    if (out != NULL) {
        for (Py_ssize_t i = 0; i < k + n_joined; i++) {
            Py_INCREF(kept[i]);
            PyTuple_SET_ITEM(out, i, kept[i]);
        }
    }
done:
    PyMem_Free(kept);
    return out;
}

static PyObject *
raised_levels(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "raised_levels(levels, raised, left, cuts, cut_above) takes 5 arguments");
        return NULL;
    }
    PyObject *levels = args[0], *raised = args[1], *left = args[2], *cuts = args[3];
    long long cut_above;
    if (!PyList_CheckExact(levels) || !PyDict_CheckExact(raised) || !PyDict_CheckExact(left)
        || read_int(args[4], &cut_above) < 0) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    Py_ssize_t n_levels = PyList_GET_SIZE(levels), n_raised = PyDict_GET_SIZE(raised), n_left = PyDict_GET_SIZE(left);
    /* the out list's depths (room for an insert per raised or left depth); the raised and the left by depth */
    Py_ssize_t *at = PyMem_Malloc((size_t)(n_levels + n_raised + n_left + 1) * sizeof(Py_ssize_t));
    rl_item *items = PyMem_Malloc((size_t)(n_raised + n_left + 1) * sizeof(rl_item));
    if (at == NULL || items == NULL) {
        PyMem_Free(at);
        PyMem_Free(items);
        return PyErr_NoMemory();
    }
    rl_item *joining = items, *leaving = items + n_raised;
    Py_ssize_t held = 0; /* items whose object a reference is held to (the first ``held`` of them) */
    PyObject *out = NULL, *result = Py_NotImplemented;
    for (Py_ssize_t i = 0; i < n_levels; i++) {
        PyObject *ids;
        if (read_level(PyList_GET_ITEM(levels, i), PY_SSIZE_T_MAX, &at[i], &ids) != 0 || !PyTuple_CheckExact(ids)
            || (i > 0 && at[i] >= at[i - 1])) {
            goto done;
        }
    }
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(raised, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key) || read_int(value, &joining[k].depth) < 0) {
            goto done;
        }
        joining[k].index = k;
        joining[k].obj = Py_NewRef(key);
        held++;
        k++;
    }
    pos = 0;
    k = 0;
    while (PyDict_Next(left, &pos, &key, &value)) {
        if (read_int(key, &leaving[k].depth) < 0 || !PyList_CheckExact(value)) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
            if (!PyUnicode_CheckExact(PyList_GET_ITEM(value, i))) {
                goto done;
            }
        }
        leaving[k].index = k;
        leaving[k].obj = Py_NewRef(value);
        held++;
        k++;
    }
    qsort(joining, (size_t)n_raised, sizeof(rl_item), rl_cmp);
    qsort(leaving, (size_t)n_left, sizeof(rl_item), rl_cmp); /* a dict's keys: one group per depth */
    result = NULL;
    out = PyList_GetSlice(levels, 0, n_levels);
    if (out == NULL) {
        goto done;
    }
    Py_ssize_t n_out = n_levels, next_join = 0, next_leave = 0;
    while (next_join < n_raised || next_leave < n_left) { /* shallowest first: the end of the list first */
        long long depth = next_join < n_raised ? joining[next_join].depth : leaving[next_leave].depth;
        if (next_leave < n_left && leaving[next_leave].depth < depth) {
            depth = leaving[next_leave].depth;
        }
        Py_ssize_t first = next_join, count = 0;
        while (next_join < n_raised && joining[next_join].depth == depth) {
            next_join++;
            count++;
        }
        PyObject *gone = NULL;
        if (next_leave < n_left && leaving[next_leave].depth == depth) {
            gone = leaving[next_leave++].obj;
        }
        Py_ssize_t lo = 0, hi = n_out; /* the first level no deeper than depth (depths fall along the list) */
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (at[mid] > depth) {
                lo = mid + 1;
            }
            else {
                hi = mid;
            }
        }
        PyObject *joined_stack[16], **joined = joined_stack;
        if (count > 16 && (joined = PyMem_Malloc((size_t)count * sizeof(PyObject *))) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            joined[i] = joining[first + i].obj;
        }
        PyObject *level = NULL;
        int drop = 0;
        if (lo < n_out && at[lo] == depth) {
            PyObject *ids = PyTuple_GET_ITEM(PyList_GET_ITEM(out, lo), 1);
            Py_ssize_t n_gone = gone != NULL ? PyList_GET_SIZE(gone) : 0;
            PyObject *const *gone_ids = gone != NULL ? &PyList_GET_ITEM(gone, 0) : NULL;
            PyObject *moved;
            if (cuts != Py_None && PyTuple_GET_SIZE(ids) > cut_above) {
                PyObject *gone_t = rl_sorted_tuple(gone_ids, n_gone);
                PyObject *joined_t = gone_t != NULL ? rl_sorted_tuple(joined, count) : NULL;
                moved = joined_t != NULL ? PyObject_CallMethod(cuts, "moved", "OOO", ids, gone_t, joined_t) : NULL;
                Py_XDECREF(gone_t);
                Py_XDECREF(joined_t);
            }
            else if (n_gone == 0 && count == 0) {
                moved = Py_NewRef(ids);
            }
            else {
                moved = rl_cut(ids, gone_ids, n_gone, joined, count);
                if (moved == Py_NotImplemented) {
                    result = Py_NotImplemented;
                }
                Py_XINCREF(moved);
            }
            if (moved == NULL || moved == Py_None || moved == Py_NotImplemented) {
                if (moved == Py_None) {
                    result = Py_None; /* not where its estimate says: the caller reads the estimates instead */
                }
                Py_XDECREF(moved);
                if (joined != joined_stack) {
                    PyMem_Free(joined);
                }
                goto done;
            }
            Py_ssize_t size = PyObject_Length(moved);
            if (size < 0) {
                Py_DECREF(moved);
                goto done;
            }
            if (size > 0) {
                level = Py_BuildValue("(LN)", depth, moved);
            }
            else {
                Py_DECREF(moved);
                drop = 1;
            }
        }
        else if (gone != NULL) {
            result = Py_None; /* no level where a raised peer's estimate says it was */
            if (joined != joined_stack) {
                PyMem_Free(joined);
            }
            goto done;
        }
        else { /* a depth none held: only joiners */
            PyObject *ids = PyTuple_New(count);
            if (ids != NULL) {
                for (Py_ssize_t i = 0; i < count; i++) {
                    PyTuple_SET_ITEM(ids, i, Py_NewRef(joined[i]));
                }
                level = Py_BuildValue("(LN)", depth, ids);
            }
            if (level != NULL && PyList_Insert(out, lo, Py_None) < 0) {
                Py_CLEAR(level);
            }
            if (level != NULL) {
                memmove(at + lo + 1, at + lo, (size_t)(n_out - lo) * sizeof(Py_ssize_t));
                at[lo] = (Py_ssize_t)depth;
                n_out++;
            }
        }
        if (joined != joined_stack) {
            PyMem_Free(joined);
        }
        if (drop) {
            if (PyList_SetSlice(out, lo, lo + 1, NULL) < 0) {
                goto done;
            }
            memmove(at + lo, at + lo + 1, (size_t)(n_out - lo - 1) * sizeof(Py_ssize_t));
            n_out--;
        }
        else if (level == NULL) {
            goto done;
        }
        else {
            PyList_SetItem(out, lo, level); /* steals level; releases what was there */
        }
    }
    result = out;
    out = NULL;
done:
    Py_XDECREF(out);
    for (Py_ssize_t i = 0; i < held; i++) { /* the raised fill items first, the left after them: the first held */
        Py_DECREF(items[i].obj);
    }
    PyMem_Free(at);
    PyMem_Free(items);
    if (result == Py_None || result == Py_NotImplemented) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        return Py_NewRef(result);
    }
    return result;
}
