/* p2pnode.routing._p2p: the default policy's ranking (routing/policies/p2p.py, from its split of the peers to its
 * empty-node rule) in one C pass, and a sparse decision's retry order (routing/candidates.py, CandidateSet.complete).
 *
 * Both run on every request's path. In Python each candidate costs a dozen attribute reads, a few tuples and a sort
 * key per step (~15 us for the 5-7 candidates of a request at 64 peers); here each peer's fields are read once into a
 * struct and the steps run over it. The Python is the definition and the fallback: either function returns None
 * wherever the request leaves the common path, and the caller then runs the Python, which decides (or raises) as it
 * always did.
 *
 * Contract (held to the Python definitions by tests/unit/test_p2p_native.py):
 *   rank(peers, sampled, home, drawn, n, bs, prompt, usable, common, uncached_weight, holders, allowance, slack,
 *        tiebreak, fill_empty, tiered, pulls, constants)
 *     -> (ids, target, chosen, best_cost, m_best, rows, target_depth) | None
 *   p2p.route after ``_sampled`` (its ``alive_peers`` included) for a request without segments: ``ids`` is its
 *   decision's ranked node ids, ``target`` / ``chosen`` the peers ranked first after / before FILL_EMPTY,
 *   ``best_cost`` the least cost, ``m_best`` the deepest row match, ``rows`` the number of candidates and
 *   ``target_depth`` the target's ``tier_blocks(...)[2]``. ``constants``: (STEP_TOKENS, STEP_OVERHEAD_TOKENS,
 *   SEQ_TOKENS). None when: an argument is not of the exact type the router passes (a float weight and allowance,
 *   tuples, a set or None, an int tiebreak in [0, 2**64), bools: an int weight keeps the Python's costs exact ints
 *   past 2**53, where doubles round); no peer is alive, a node id is there twice (``alive_peers`` raises) or
 *   ``peers`` is not a list or tuple; no candidate
 *   row; ``tiered`` and a row's tier reaches past its match (the policy prices the load); ``pulls`` and a row could
 *   source a pull (a link figure, a KV layout, a match); a field that is not an int (or a bool) where one is read, or
 *   beyond 2**50 (the sort keys are doubles, exact below 2**53); a node id that is not a str; an integer overflow; a
 *   NaN cost; no candidate within the bound.
 *
 *   complete(ranked, alive, self_id) -> tuple | None
 *   ``ranked`` followed by every id of ``alive`` (distinct: a peer table's) that is not in it, in ``alive``'s order;
 *   None when ``ranked`` holds more than 16 ids, when one of them (``self_id`` aside) is not in ``alive`` or appears
 *   twice (the Python raises), when ``self_id`` is in ``alive``, or for anything but two tuples and a str.
 *
 *   draw_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders, sorted_alive, sorted_above) -> tuple | None
 *   types.draw_holders_by_depth (``sorted_above``: its DRAW_FROM_SORTED_ABOVE): from the levels (a list of
 *   ``(depth, ids)``, deepest first), the deepest runs of ids not in ``exclude`` for which ``alive(id)`` holds, each
 *   sorted and rotated by ``tiebreak``, up to ``holders`` ids; a large level alone at its depth is read from
 *   ``sorted_alive(ids)`` by bisection. ``alive`` and ``sorted_alive`` are called as the Python calls them, their
 *   errors raised; the levels are read from the live list at each step, and a run's ids copied before ``alive`` is
 *   asked of them, as the Python does (a callback may change either). None when: levels is not a list; a level read
 *   is not a 2-tuple of an int and a tuple or list, or an id in it not a str; an int is past a Py_ssize_t;
 *   ``exclude`` is not a set or frozenset of str; ``sorted_alive`` gives something other than a list or tuple of
 *   str. Where that is found after a callback ran for an earlier depth, the Python runs it again (the router's
 *   callbacks only read).
 *
 *   raised_levels(levels, raised, left, cuts, cut_above) -> list | None | NotImplemented
 *   estimates.raised_levels (``cut_above``: its CUT_REMEMBERED_ABOVE): raised_levels.h says when it gives
 *   NotImplemented (the caller then runs the Python).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The costs must be the Python's doubles to the bit: no fused multiply-add, whatever the build's flags (GCC reads the
 * pragma, clang the standard one; pyproject.toml passes -ffp-contract=off too). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "structmember.h"

#define LIMIT (1LL << 50)

static PyObject *s_node_id, *s_alive, *s_is_self, *s_est_match_blocks, *s_load, *s_in_flight, *s_est_disk_blocks,
    *s_est_host_blocks, *s_cached_blocks, *s_kv_layout, *s_link_bytes_per_s, *s_running, *s_waiting,
    *s_prefill_backlog_tokens;

/* One alive peer's fields, read once. */
typedef struct {
    PyObject *peer; /* borrowed: ``alive`` holds it */
    PyObject *id;   /* new reference */
    long long match, running, waiting, in_flight, load, backlog, disk, host;
    int has_backlog, is_self, in_home, read_tiers;
    /* as a candidate row */
    long long m, eff;
    double cost;
} peer_t;

/* A sort entry of rank_keyed: (key, node id, peer). */
typedef struct {
    double key[4];
    int width;
    PyObject *id;
    Py_ssize_t peer;
} keyed_t;

/* An int attribute within +-LIMIT: 0, or -1 (the error cleared) for anything else. */
static int
read_int(PyObject *value, long long *out)
{
    if (value == NULL || !(PyLong_CheckExact(value) || PyBool_Check(value))) { /* a subclass may do its own sums */
        PyErr_Clear();
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred()) || v > LIMIT || v < -LIMIT) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

/* Where each field name was last found: a type and the offset of its slot there (-1: read it through getattr). */
#define SLOT_CACHE 16
static struct {
    PyObject *name;
    PyTypeObject *type; /* a strong reference */
    Py_ssize_t offset;
} slot_cache[SLOT_CACHE];

#ifdef Py_T_OBJECT_EX
#define OBJECT_SLOT Py_T_OBJECT_EX
#else
#define OBJECT_SLOT T_OBJECT_EX
#endif

/* The offset of ``name``'s slot in ``tp``'s instances when reading it there is exactly what getattr would do -- the
 * type's getattr is the generic one and ``name`` resolves to a member descriptor of an object slot (a slots
 * dataclass's field: PeerSnapshot's, NodeLoad's) -- else -1. */
static Py_ssize_t
slot_offset(PyTypeObject *tp, PyObject *name)
{
    if (tp->tp_getattro != PyObject_GenericGetAttr) {
        return -1;
    }
    PyObject *descr = _PyType_Lookup(tp, name); /* borrowed; sets no error */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)
        || !PyType_IsSubtype(tp, ((PyDescrObject *)descr)->d_type)) { /* another class's slot: its offset, not ours */
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == OBJECT_SLOT && !(member->flags & READ_RESTRICTED) ? member->offset : -1;
}

/* ``getattr(obj, name)`` (a new reference, or NULL with the error set), reading a slots dataclass's field straight
 * from its slot: a peer's dozen fields are most of what the ranking reads. ``name``: one of the interned names. */
static PyObject *
attr(PyObject *obj, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(obj);
    for (int i = 0; i < SLOT_CACHE; i++) {
        if (slot_cache[i].name == name || slot_cache[i].name == NULL) {
            if (slot_cache[i].name == NULL || slot_cache[i].type != tp) {
                Py_XSETREF(slot_cache[i].type, (PyTypeObject *)Py_NewRef(tp));
                slot_cache[i].name = name;
                slot_cache[i].offset = slot_offset(tp, name);
            }
            if (slot_cache[i].offset >= 0) {
                PyObject *value = *(PyObject **)((char *)obj + slot_cache[i].offset);
                if (value != NULL) {
                    return Py_NewRef(value);
                }
            }
            break;
        }
    }
    return PyObject_GetAttr(obj, name); /* anything else, and an unset slot's AttributeError */
}

static int
attr_int(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *value = attr(obj, name);
    int rc = read_int(value, out);
    Py_XDECREF(value);
    return rc;
}

static int
read_peer(PyObject *peer, PyObject *home, peer_t *p)
{
    p->peer = peer;
    p->id = attr(peer, s_node_id);
    if (p->id == NULL || !PyUnicode_CheckExact(p->id)) {
        PyErr_Clear();
        return -1;
    }
    PyObject *flag = attr(peer, s_is_self);
    p->is_self = flag == NULL ? -1 : PyObject_IsTrue(flag);
    Py_XDECREF(flag);
    p->in_home = p->is_self < 0 ? -1 : PySequence_Contains(home, p->id);
    if (p->in_home < 0) {
        PyErr_Clear();
        return -1;
    }
    if (attr_int(peer, s_est_match_blocks, &p->match) < 0 || attr_int(peer, s_in_flight, &p->in_flight) < 0) {
        return -1;
    }
    PyObject *load = attr(peer, s_load);
    if (load == NULL) {
        PyErr_Clear();
        return -1;
    }
    int rc = attr_int(load, s_running, &p->running) | attr_int(load, s_waiting, &p->waiting);
    PyObject *backlog = rc < 0 ? NULL : attr(load, s_prefill_backlog_tokens);
    Py_DECREF(load);
    if (backlog == NULL) {
        PyErr_Clear();
        return -1;
    }
    p->has_backlog = backlog != Py_None;
    p->backlog = 0;
    rc = p->has_backlog ? read_int(backlog, &p->backlog) : 0;
    Py_DECREF(backlog);
    if (rc < 0) {
        return -1;
    }
    p->load = p->running + p->waiting + p->in_flight; /* ``requests`` */
    p->read_tiers = 0;
    return 0;
}

static int
read_tiers(peer_t *p)
{
    if (!p->read_tiers) {
        if (attr_int(p->peer, s_est_disk_blocks, &p->disk) < 0 || attr_int(p->peer, s_est_host_blocks, &p->host) < 0) {
            return -1;
        }
        p->read_tiers = 1;
    }
    return 0;
}

static int
compare_keyed(const void *a, const void *b)
{
    const keyed_t *x = a, *y = b;
    for (int i = 0; i < x->width; i++) {
        if (x->key[i] < y->key[i]) {
            return -1;
        }
        if (x->key[i] > y->key[i]) {
            return 1;
        }
    }
    return PyUnicode_Compare(x->id, y->id); /* two str: never fails; unique, so never 0 */
}

static int
same_key(const keyed_t *x, const keyed_t *y)
{
    for (int i = 0; i < x->width; i++) {
        if (x->key[i] != y->key[i]) {
            return 0;
        }
    }
    return 1;
}

/* types.rank_keyed: ``keyed`` by (key, id), each run of equal keys rotated by ``tiebreak``; the peers' indices are
 * written to ``out`` (``count`` of them). */
static void
rank_keyed(keyed_t *keyed, Py_ssize_t count, unsigned long long tiebreak, Py_ssize_t *out)
{
    qsort(keyed, (size_t)count, sizeof(keyed_t), compare_keyed);
    Py_ssize_t i = 0, w = 0;
    while (i < count) {
        Py_ssize_t j = i + 1;
        while (j < count && same_key(&keyed[i], &keyed[j])) {
            j++;
        }
        Py_ssize_t shift = i + (Py_ssize_t)(tiebreak % (unsigned long long)(j - i));
        for (Py_ssize_t k = shift; k < j; k++) {
            out[w++] = keyed[k].peer;
        }
        for (Py_ssize_t k = i; k < shift; k++) {
            out[w++] = keyed[k].peer;
        }
        i = j;
    }
}

/* p2p.cost with these integer inputs; -1 (no result) on an overflow. */
static int
cost_of(long long backlog, long long uncached, long long load, double weight, const long long *c, double *out)
{
    long long work, steps, per_step, step_part;
    if (__builtin_add_overflow(backlog, uncached, &work)) {
        return -1;
    }
    steps = work > c[0] ? work / c[0] + (work % c[0] != 0) : 1; /* the ceiling, without overflowing near the top */
    if (__builtin_mul_overflow(c[2], load, &per_step) || __builtin_add_overflow(per_step, c[1], &per_step)
        || __builtin_mul_overflow(steps, per_step, &step_part)) {
        return -1;
    }
    *out = (double)backlog + weight * (double)uncached + (double)step_part;
    return 0;
}

/* backlog_tokens(p, uncached) */
static int
backlog_of(const peer_t *p, long long uncached, long long *out)
{
    if (p->has_backlog) {
        *out = p->backlog;
        return 0;
    }
    return __builtin_mul_overflow(p->waiting + p->in_flight, uncached, out) ? -1 : 0;
}

/* str equality as Python's own, without a call where it can tell at once: the same object, else a cached hash
 * (-1: not computed yet), the length, the kind, then the bytes. */
static inline int
same_str(PyObject *a, PyObject *b, Py_hash_t hash_a)
{
    if (a == b) {
        return 1;
    }
    Py_hash_t cached = ((PyASCIIObject *)b)->hash;
    Py_ssize_t length = PyUnicode_GET_LENGTH(a);
    return (cached == -1 || hash_a == -1 || cached == hash_a) && PyUnicode_GET_LENGTH(b) == length
        && PyUnicode_KIND(b) == PyUnicode_KIND(a)
        && memcmp(PyUnicode_DATA(b), PyUnicode_DATA(a), (size_t)length * (size_t)PyUnicode_KIND(a)) == 0;
}

/* types.alive_peers: the alive ones of ``peers`` (a list or tuple) as a new list; None (a new reference) where the
 * Python raises -- no peer alive, a node id twice -- or reads what this does not (an id that is not a str). */
static PyObject *
alive_of(PyObject *given)
{
    if (!PyList_CheckExact(given) && !PyTuple_CheckExact(given)) {
        return Py_NewRef(Py_None);
    }
    /* a tuple of them: nothing an attribute read runs can change what is being read */
    PyObject *peers = PyList_CheckExact(given) ? PyList_AsTuple(given) : Py_NewRef(given);
    if (peers == NULL) {
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(peers), held = 0;
    PyObject **items = &PyTuple_GET_ITEM(peers, 0), *alive = PyList_New(0), *seen = NULL, *ids[16];
    int ok = alive != NULL && (count <= 16 || (seen = PySet_New(NULL)) != NULL);
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        PyObject *id = attr(items[i], s_node_id);
        ok = id != NULL && PyUnicode_CheckExact(id);
        if (ok && seen != NULL) {
            ok = PySet_Add(seen, id) == 0;
            Py_DECREF(id);
        }
        else if (ok) {
            Py_hash_t hash = PyObject_Hash(id);
            for (Py_ssize_t j = 0; j < held && ok; j++) {
                ok = !same_str(id, ids[j], hash); /* a node id twice: the Python raises */
            }
            ids[held++] = id; /* released below */
        }
        else {
            Py_XDECREF(id);
        }
        PyObject *flag = ok ? attr(items[i], s_alive) : NULL;
        int is_alive = flag == NULL ? -1 : PyObject_IsTrue(flag);
        Py_XDECREF(flag);
        ok = ok && is_alive >= 0 && !(is_alive && PyList_Append(alive, items[i]) < 0);
    }
    ok = ok && (seen == NULL || PySet_GET_SIZE(seen) == count) && PyList_GET_SIZE(alive) > 0;
    for (Py_ssize_t j = 0; j < held; j++) {
        Py_DECREF(ids[j]);
    }
    Py_XDECREF(seen);
    Py_DECREF(peers);
    if (!ok) {
        Py_XDECREF(alive);
        PyErr_Clear();
        return Py_NewRef(Py_None);
    }
    return alive;
}

static PyObject *
rank(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 18) {
        PyErr_SetString(PyExc_TypeError, "rank() takes 18 arguments");
        return NULL;
    }
    /* Anything but the types the router passes: the Python decides (an int weight, say, keeps its costs exact ints
     * there, which doubles would round past 2**53). */
    PyObject *sampled = args[1], *home = args[2], *drawn = args[3], *constants = args[17];
    if (!(sampled == Py_None || PySet_CheckExact(sampled)) || !PyTuple_CheckExact(home) || !PyTuple_CheckExact(drawn)
        || !PyTuple_CheckExact(constants) || PyTuple_GET_SIZE(constants) != 3 || !PyFloat_CheckExact(args[9])
        || !PyFloat_CheckExact(args[11]) || !PyLong_CheckExact(args[13]) || !PyBool_Check(args[14])
        || !PyBool_Check(args[15]) || !PyBool_Check(args[16])) {
        Py_RETURN_NONE;
    }
    long long n, bs, prompt, usable, common, holders, slack, c[3];
    if (read_int(args[4], &n) < 0 || read_int(args[5], &bs) < 0 || read_int(args[6], &prompt) < 0
        || read_int(args[7], &usable) < 0 || read_int(args[8], &common) < 0 || read_int(args[10], &holders) < 0
        || read_int(args[12], &slack) < 0 || read_int(PyTuple_GET_ITEM(constants, 0), &c[0]) < 0
        || read_int(PyTuple_GET_ITEM(constants, 1), &c[1]) < 0 || read_int(PyTuple_GET_ITEM(constants, 2), &c[2]) < 0
        || c[0] <= 0) {
        Py_RETURN_NONE;
    }
    double weight = PyFloat_AS_DOUBLE(args[9]), allowance = PyFloat_AS_DOUBLE(args[11]);
    unsigned long long tiebreak = PyLong_AsUnsignedLongLong(args[13]);
    if (tiebreak == (unsigned long long)-1 && PyErr_Occurred()) { /* negative, or past 64 bits */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int fill_empty = args[14] == Py_True, tiered = args[15] == Py_True, pulls = args[16] == Py_True;

    PyObject *alive = alive_of(args[0]), *result = NULL;
    if (alive == NULL || alive == Py_None) {
        return alive;
    }
    Py_ssize_t count = PyList_GET_SIZE(alive), read = 0;
    peer_t *peers = PyMem_Calloc((size_t)count + 1, sizeof(peer_t));
    keyed_t *keyed = PyMem_Malloc(((size_t)count + 1) * sizeof(keyed_t));
    /* indices into peers, four slices of one buffer: the rows in order, the ranked list, the others, the matched */
    Py_ssize_t *rows = PyMem_Malloc(((size_t)count + 1) * sizeof(Py_ssize_t) * 4);
    if (peers == NULL || keyed == NULL || rows == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *ranked = rows + count + 1, *others = ranked + count + 1, *matched = others + count + 1;
    Py_ssize_t n_rows = 0, n_others = 0, n_matched = 0;

    /* _split */
    for (; read < count; read++) {
        peer_t *p = &peers[read];
        if (read_peer(PyList_GET_ITEM(alive, read), home, p) < 0) {
            read++; /* its id, if read, is released below */
            goto bail;
        }
        long long m = p->match;
        p->m = m < 0 ? 0 : (m > n ? n : m);
        int in_sample = 0;
        if (sampled != Py_None && !p->is_self && !p->in_home) {
            in_sample = PySet_Contains(sampled, p->id);
            if (in_sample < 0) {
                read++;
                goto bail;
            }
        }
        if (sampled == Py_None || p->is_self || in_sample || p->in_home) {
            rows[n_rows++] = read;
            continue;
        }
        if (read_tiers(p) < 0) {
            read++;
            goto bail;
        }
        long long deep = p->m;
        if (p->disk > p->m) {
            deep = p->disk < n ? p->disk : n;
        }
        if (deep) {
            p->eff = deep; /* the holder's depth, until it is a row */
            matched[n_matched++] = read;
        }
        else {
            others[n_others++] = read;
        }
    }

    /* _add_holders */
    if (n_matched) {
        Py_ssize_t n_deepest, *order = ranked; /* scratch until the ranking */
        if (PyTuple_GET_SIZE(drawn) && holders > 0) { /* the router's draw: those of it, in the peers' order */
            for (Py_ssize_t i = 0; i < n_matched; i++) {
                peer_t *p = &peers[matched[i]];
                int chosen = PySequence_Contains(drawn, p->id);
                if (chosen < 0) {
                    goto bail;
                }
                if (chosen) {
                    p->m = p->match <= n ? p->match : n;
                    rows[n_rows++] = matched[i];
                }
                else {
                    others[n_others++] = matched[i];
                }
            }
        }
        else {
            for (Py_ssize_t i = 0; i < n_matched; i++) {
                peer_t *p = &peers[matched[i]];
                keyed[i] = (keyed_t){{-(double)p->eff}, 1, p->id, matched[i]};
            }
            rank_keyed(keyed, n_matched, tiebreak, order);
            n_deepest = holders <= 0 ? n_matched : (holders < n_matched ? holders : n_matched);
            for (Py_ssize_t i = 0; i < n_matched; i++) {
                peer_t *p = &peers[order[i]];
                if (i < n_deepest) {
                    p->m = p->match <= n ? p->match : n;
                    rows[n_rows++] = order[i];
                }
                else {
                    others[n_others++] = order[i];
                }
            }
        }
    }
    if (!n_rows) {
        goto bail; /* neither this node nor the sample serves it: the Python takes every peer */
    }

    /* a tier reaching past a row's match, or a pull source among the rows: the Python prices them */
    for (Py_ssize_t i = 0; i < n_rows && (tiered || (pulls && n_rows > 1 && usable > 0)); i++) {
        peer_t *p = &peers[rows[i]];
        if (tiered) {
            if (read_tiers(p) < 0) {
                goto bail;
            }
            if (p->disk > p->m || p->host > p->m) {
                goto bail;
            }
        }
        if (pulls && n_rows > 1 && usable > 0 && p->m > 0) {
            PyObject *link = attr(p->peer, s_link_bytes_per_s);
            double rate = link == NULL ? -1.0 : PyFloat_AsDouble(link);
            Py_XDECREF(link);
            if (PyErr_Occurred()) {
                goto bail;
            }
            if (rate > 0 || isnan(rate)) {
                PyObject *layout = attr(p->peer, s_kv_layout);
                int has_layout = layout == NULL ? -1 : PyObject_IsTrue(layout);
                Py_XDECREF(layout);
                if (has_layout != 0) {
                    goto bail;
                }
            }
        }
    }

    /* _costs */
    double best = 0.0;
    long long m_best = 0;
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        peer_t *p = &peers[rows[i]];
        long long eff = p->m < usable ? p->m : usable, uncached, backlog, step;
        if (eff < common) {
            eff = common;
        }
        if (__builtin_mul_overflow(eff, bs, &step) || __builtin_sub_overflow(prompt, step, &uncached)
            || backlog_of(p, uncached, &backlog) < 0 || cost_of(backlog, uncached, p->load, weight, c, &p->cost) < 0
            || isnan(p->cost)) {
            goto bail;
        }
        p->eff = eff;
        if (i == 0 || p->cost < best) {
            best = p->cost;
        }
        if (i == 0 || p->m > m_best) {
            m_best = p->m;
        }
    }

    /* _ranked */
    double bound = allowance * best + (double)slack;
    Py_ssize_t n_allowed = 0, n_ranked = 0;
    for (Py_ssize_t i = 0; i < n_rows; i++) {
        peer_t *p = &peers[rows[i]];
        if (p->cost <= bound) {
            keyed[n_allowed++] = (keyed_t){
                {-(double)p->eff, (double)!p->in_home, p->cost, (double)!p->is_self}, 4, p->id, rows[i]};
        }
    }
    if (!n_allowed) {
        goto bail;
    }
    rank_keyed(keyed, n_allowed, tiebreak, ranked);
    n_ranked = n_allowed;
    if (n_allowed < n_rows) {
        Py_ssize_t n_over = 0;
        for (Py_ssize_t i = 0; i < n_rows; i++) {
            peer_t *p = &peers[rows[i]];
            if (p->cost > bound) {
                keyed[n_over++] = (keyed_t){{p->cost, -(double)p->eff, (double)!p->is_self}, 3, p->id, rows[i]};
            }
        }
        rank_keyed(keyed, n_over, tiebreak, ranked + n_ranked);
        n_ranked += n_over;
    }
    if (n_others) {
        for (Py_ssize_t i = 0; i < n_others; i++) {
            peer_t *p = &peers[others[i]];
            keyed[i] = (keyed_t){{(double)p->load, 0.0}, 2, p->id, others[i]};
        }
        rank_keyed(keyed, n_others, tiebreak, ranked + n_ranked);
        n_ranked += n_others;
    }
    Py_ssize_t chosen = ranked[0];

    /* _empty_first */
    peer_t *target = &peers[ranked[0]];
    int queued = target->waiting || target->in_flight || (target->has_backlog && target->backlog);
    if (fill_empty && n_rows > 1 && queued) {
        Py_ssize_t first = -1;
        double first_ttft = 0.0;
        for (Py_ssize_t i = 0; i < n_rows; i++) {
            peer_t *p = &peers[rows[i]];
            if (p->load != 0 || (p->has_backlog && p->backlog)) {
                continue;
            }
            PyObject *cached = attr(p->peer, s_cached_blocks);
            if (cached == NULL) {
                goto bail;
            }
            long long blocks = 1;
            int is_none = cached == Py_None;
            int rc = is_none ? 0 : read_int(cached, &blocks);
            Py_DECREF(cached);
            if (rc < 0) {
                goto bail;
            }
            if (is_none || blocks != 0) {
                continue;
            }
            long long backlog;
            double ttft;
            if (backlog_of(p, prompt, &backlog) < 0 || cost_of(backlog, prompt, p->load, 1.0, c, &ttft) < 0) {
                goto bail;
            }
            if (first < 0 || ttft < first_ttft
                || (ttft == first_ttft && PyUnicode_Compare(p->id, peers[first].id) < 0)) {
                first = rows[i];
                first_ttft = ttft;
            }
        }
        if (first >= 0) {
            long long uncached, backlog, step;
            double target_ttft;
            if (__builtin_mul_overflow(target->eff, bs, &step) || __builtin_sub_overflow(prompt, step, &uncached)
                || backlog_of(target, uncached, &backlog) < 0
                || cost_of(backlog, uncached, target->load, 1.0, c, &target_ttft) < 0) {
                goto bail;
            }
            if (first_ttft < target_ttft) {
                Py_ssize_t at = 0;
                while (ranked[at] != first) {
                    at++;
                }
                for (; at > 0; at--) {
                    ranked[at] = ranked[at - 1];
                }
                ranked[0] = first;
                target = &peers[first];
            }
        }
    }

    /* the target's tier_blocks(...)[2] */
    if (read_tiers(target) < 0) {
        goto bail;
    }
    long long depth = target->match < 0 ? 0 : (target->match > n ? n : target->match);
    if (target->host > depth || target->disk > depth) {
        long long host = target->host > depth ? target->host : depth;
        host = host < n ? host : n;
        depth = target->disk > host ? target->disk : host;
        depth = depth < n ? depth : n;
    }

    PyObject *ids = PyTuple_New(n_ranked);
    if (ids == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_ranked; i++) {
        PyTuple_SET_ITEM(ids, i, Py_NewRef(peers[ranked[i]].id));
    }
    result = Py_BuildValue("(NOOdLnL)", ids, target->peer, peers[chosen].peer, best, m_best, n_rows, depth);
    goto done;

bail:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    if (peers != NULL) {
        for (Py_ssize_t i = 0; i < read; i++) {
            Py_XDECREF(peers[i].id);
        }
    }
    PyMem_Free(peers);
    PyMem_Free(keyed);
    PyMem_Free(rows);
    Py_DECREF(alive);
    return result;
}

/* Where ``id`` is in ``items``: by identity (the ids of a decision are the peer table's own objects), else by value;
 * -1 if nowhere. */
static Py_ssize_t
position_in(PyObject *id, PyObject *const *items, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++) {
        if (items[i] == id) {
            return i;
        }
    }
    Py_hash_t hash = PyObject_Hash(id);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyUnicode_CheckExact(items[i]) && same_str(id, items[i], hash)) {
            return i;
        }
    }
    return -1;
}

static int
compare_positions(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

#define COMPLETE_MAX_RANKED 16

static PyObject *
complete(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "complete(ranked: tuple, alive: tuple, self_id: str)");
        return NULL;
    }
    if (!PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyUnicode_CheckExact(args[2])) {
        Py_RETURN_NONE; /* not what the router passes: the Python */
    }
    PyObject *ranked = args[0], *alive = args[1], *self_id = args[2];
    PyObject *const *items = &PyTuple_GET_ITEM(alive, 0);
    Py_ssize_t k = PyTuple_GET_SIZE(ranked), count = PyTuple_GET_SIZE(alive), cuts[COMPLETE_MAX_RANKED + 1];
    Py_ssize_t n_cuts = 0;
    if (k > COMPLETE_MAX_RANKED) {
        Py_RETURN_NONE; /* a full decision: the Python's set is the better tool */
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *id = PyTuple_GET_ITEM(ranked, i);
        if (!PyUnicode_CheckExact(id)) {
            Py_RETURN_NONE;
        }
        if (id == self_id || PyUnicode_Compare(id, self_id) == 0) {
            continue;
        }
        Py_ssize_t at = position_in(id, items, count);
        if (at < 0) {
            Py_RETURN_NONE; /* not an alive peer: the Python raises */
        }
        cuts[n_cuts++] = at;
    }
    qsort(cuts, (size_t)n_cuts, sizeof(Py_ssize_t), compare_positions);
    for (Py_ssize_t i = 1; i < n_cuts; i++) {
        if (cuts[i] == cuts[i - 1]) {
            Py_RETURN_NONE; /* ranked twice: the Python raises */
        }
    }
    if (n_cuts == count) {
        return Py_NewRef(ranked);
    }
    PyObject *result = PyTuple_New(k + count - n_cuts);
    if (result == NULL) {
        return NULL;
    }
    PyObject **out = &PyTuple_GET_ITEM(result, 0);
    for (Py_ssize_t i = 0; i < k; i++) {
        *out++ = Py_NewRef(PyTuple_GET_ITEM(ranked, i));
    }
    cuts[n_cuts] = count;
    Py_hash_t self_hash = PyObject_Hash(self_id);
    for (Py_ssize_t c = 0, start = 0; c <= n_cuts; c++) { /* the alive ids between two ranked ones */
        for (Py_ssize_t i = start; i < cuts[c]; i++) {
            if (items[i] == self_id || (PyUnicode_CheckExact(items[i]) && same_str(self_id, items[i], self_hash))) {
                Py_DECREF(result); /* this node among its peers (never a peer table's): the Python; the slots not */
                Py_RETURN_NONE;    /* yet written are NULL, which a tuple's dealloc skips */
            }
            *out++ = Py_NewRef(items[i]);
        }
        start = cuts[c] + 1;
    }
    return result;
}

/* ``levels[i]`` read from the live list, as the Python reads it at each step (a callback may change the list): a
 * new reference, or NULL with the Python's IndexError where the list has shrunk. */
static PyObject *
level_at(PyObject *levels, Py_ssize_t i)
{
    if (i >= PyList_GET_SIZE(levels)) {
        PyErr_SetString(PyExc_IndexError, "list index out of range");
        return NULL;
    }
    return Py_NewRef(PyList_GET_ITEM(levels, i));
}

/* A level of draw_by_depth: its depth clamped to n_blocks and its ids (borrowed from ``level``); 0, or 1 when it is
 * not an (int, tuple | list) pair (the Python's path). */
static int
read_level(PyObject *level, Py_ssize_t n_blocks, Py_ssize_t *depth, PyObject **ids)
{
    if (!PyTuple_CheckExact(level) || PyTuple_GET_SIZE(level) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(level, 0))) {
        return 1;
    }
    *ids = PyTuple_GET_ITEM(level, 1);
    if (!PyTuple_CheckExact(*ids) && !PyList_CheckExact(*ids)) {
        return 1;
    }
    Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(level, 0));
    if (at == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    *depth = at < n_blocks ? at : n_blocks;
    return 0;
}

/* The clamped depth of ``levels[i]``: 0, 1 (the Python's path) or -1 (an error set). */
static int
depth_at(PyObject *levels, Py_ssize_t i, Py_ssize_t n_blocks, Py_ssize_t *depth)
{
    PyObject *ids, *level = level_at(levels, i);
    if (level == NULL) {
        return -1;
    }
    int rc = read_level(level, n_blocks, depth, &ids);
    Py_DECREF(level);
    return rc;
}

/* ``ids`` (a tuple or list) appended to ``into``; 1 where one is not a str (the Python's path), -1 on an error. */
static int
gather_ids(PyObject *into, PyObject *ids)
{
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(ids); k++) {
        PyObject *id = PySequence_Fast_GET_ITEM(ids, k);
        if (!PyUnicode_CheckExact(id)) {
            return 1;
        }
        if (PyList_Append(into, id) < 0) {
            return -1;
        }
    }
    return 0;
}

/* tiebreak % size as Python's % gives it (size > 0), or -1 with an exception set. */
static Py_ssize_t
rotation(PyObject *tiebreak, Py_ssize_t size)
{
    PyObject *modulus = PyLong_FromSsize_t(size);
    PyObject *shift = modulus == NULL ? NULL : PyNumber_Remainder(tiebreak, modulus);
    Py_XDECREF(modulus);
    if (shift == NULL) {
        return -1;
    }
    Py_ssize_t out = PyLong_AsSsize_t(shift);
    Py_DECREF(shift);
    return out;
}

/* types._rotated_head: the first ``count`` ids of ``run`` (sorted, a list or tuple of str) without ``exclude``,
 * rotated by ``tiebreak``, appended to ``out``. 0; 1 where an id is not a str (the Python's path); -1 on an error. */
static int
rotated_head(PyObject *run, PyObject *exclude, PyObject *tiebreak, Py_ssize_t count, PyObject *out)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(run), removed_n = 0;
    PyObject *const *items = PySequence_Fast_ITEMS(run);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_CheckExact(items[i])) {
            return 1;
        }
    }
    /* exclude's members (an exact set: its iteration runs no Python code, nor do the str comparisons below) */
    Py_ssize_t *removed = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(PySet_GET_SIZE(exclude) + 1));
    PyObject *members = removed == NULL ? NULL : PyObject_GetIter(exclude), *key;
    if (members == NULL) {
        PyMem_Free(removed);
        return removed == NULL ? (PyErr_NoMemory(), -1) : -1;
    }
    int rc = 0;
    while (rc == 0 && (key = PyIter_Next(members)) != NULL) {
        if (!PyUnicode_CheckExact(key)) {
            rc = 1;
        }
        Py_ssize_t lo = 0, hi = n; /* bisect_left */
        while (rc == 0 && lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (PyUnicode_Compare(items[mid], key) < 0) {
                lo = mid + 1;
            }
            else {
                hi = mid;
            }
        }
        if (rc == 0 && lo < n && PyUnicode_Compare(items[lo], key) == 0) {
            removed[removed_n++] = lo;
        }
        Py_DECREF(key);
    }
    Py_DECREF(members);
    if (rc == 0 && PyErr_Occurred()) {
        rc = -1;
    }
    qsort(removed, (size_t)removed_n, sizeof(Py_ssize_t), compare_positions);
    Py_ssize_t size = n - removed_n;
    if (rc == 0 && size > 0) {
        Py_ssize_t shift = rotation(tiebreak, size);
        if (shift < 0) {
            rc = -1;
        }
        for (Py_ssize_t rank = shift; rc == 0 && rank < shift + (count < size ? count : size); rank++) {
            Py_ssize_t at = rank % size;
            for (Py_ssize_t g = 0; g < removed_n && removed[g] <= at; g++) {
                at++;
            }
            rc = PyList_Append(out, items[at]);
        }
    }
    PyMem_Free(removed);
    return rc;
}

/* One step of draw_by_depth from ``levels[i]`` (clamped ``depth``, ``ids``): the run of that depth drawn into
 * ``out``; *next is the level after it. 0, 1 (the Python's path) or -1 (an error set). */
static int
draw_step(PyObject *levels, Py_ssize_t i, Py_ssize_t count, Py_ssize_t n_blocks, Py_ssize_t depth, PyObject *ids,
          PyObject *const *args, Py_ssize_t holders, Py_ssize_t sorted_above, Py_ssize_t *next, PyObject *out)
{
    PyObject *tiebreak = args[2], *exclude = args[3], *alive = args[4], *sorted_alive = args[6];
    Py_ssize_t next_depth = 0;
    int rc = 0;
    if (sorted_alive != Py_None && PySequence_Fast_GET_SIZE(ids) > sorted_above) {
        if (i + 1 < count && (rc = depth_at(levels, i + 1, n_blocks, &next_depth)) != 0) {
            return rc;
        }
        if (i + 1 == count || next_depth != depth) { /* a large level alone at its depth: from its sorted ids */
            PyObject *run = PyObject_CallOneArg(sorted_alive, ids);
            if (run == NULL) {
                return -1;
            }
            rc = PyList_CheckExact(run) || PyTuple_CheckExact(run)
                ? rotated_head(run, exclude, tiebreak, holders - PyList_GET_SIZE(out), out) : 1;
            Py_DECREF(run);
            *next = i + 1;
            return rc;
        }
    }
    /* the ids of every level of this depth, read and copied before any call to alive (as the Python's list) */
    PyObject *ids_of_run = PyList_New(0);
    if (ids_of_run == NULL) {
        return -1;
    }
    rc = gather_ids(ids_of_run, ids);
    Py_ssize_t j = i + 1;
    for (; rc == 0 && j < count; j++) {
        PyObject *more, *level = level_at(levels, j);
        Py_ssize_t at;
        rc = level == NULL ? -1 : read_level(level, n_blocks, &at, &more);
        if (rc == 0 && at == depth) {
            rc = gather_ids(ids_of_run, more);
        }
        Py_XDECREF(level);
        if (rc != 0 || at != depth) {
            break;
        }
    }
    *next = j;
    PyObject *run = rc == 0 ? PyList_New(0) : NULL;
    for (Py_ssize_t k = 0; run != NULL && rc == 0 && k < PyList_GET_SIZE(ids_of_run); k++) {
        PyObject *id = PyList_GET_ITEM(ids_of_run, k); /* held by ids_of_run, which only this reads */
        int out_of = PySet_Contains(exclude, id);
        if (out_of < 0) {
            rc = -1;
        }
        else if (!out_of) {
            PyObject *verdict = PyObject_CallOneArg(alive, id);
            int yes = verdict == NULL ? -1 : PyObject_IsTrue(verdict);
            Py_XDECREF(verdict);
            rc = yes < 0 ? -1 : yes ? PyList_Append(run, id) : 0;
        }
    }
    Py_DECREF(ids_of_run);
    if (rc == 0 && run == NULL) {
        rc = -1;
    }
    Py_ssize_t size = rc == 0 ? PyList_GET_SIZE(run) : 0;
    if (size > 0 && (rc = PyList_Sort(run)) == 0) {
        Py_ssize_t shift = rotation(tiebreak, size);
        rc = shift < 0 ? -1 : 0;
        for (Py_ssize_t k = 0; rc == 0 && k < size; k++) {
            rc = PyList_Append(out, PyList_GET_ITEM(run, (shift + k) % size));
        }
    }
    Py_XDECREF(run);
    return rc;
}

static PyObject *
draw_by_depth(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "draw_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders, "
                                         "sorted_alive, sorted_above)");
        return NULL;
    }
    PyObject *levels = args[0];
    if (!PyList_CheckExact(levels) || !PyLong_CheckExact(args[2]) || !PyAnySet_CheckExact(args[3])
        || !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[5]) || !PyLong_CheckExact(args[7])) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n_blocks = PyLong_AsSsize_t(args[1]), holders = PyLong_AsSsize_t(args[5]);
    Py_ssize_t sorted_above = PyLong_AsSsize_t(args[7]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* every member of exclude a str, checked before any callback runs (a hand-back after one would run it twice) */
    PyObject *members = PyObject_GetIter(args[3]), *member;
    if (members == NULL) {
        return NULL;
    }
    int odd = 0;
    while (!odd && (member = PyIter_Next(members)) != NULL) {
        odd = !PyUnicode_CheckExact(member);
        Py_DECREF(member);
    }
    Py_DECREF(members);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (odd) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    int rc = 0; /* 1: the Python's path */
    Py_ssize_t i = 0, count = PyList_GET_SIZE(levels); /* the Python's ``count``, read once */
    while (rc == 0 && i < count && PyList_GET_SIZE(out) < holders) {
        Py_ssize_t depth;
        PyObject *ids, *level = level_at(levels, i);
        rc = level == NULL ? -1 : read_level(level, n_blocks, &depth, &ids);
        if (rc == 0 && depth > 0) {
            rc = draw_step(levels, i, count, n_blocks, depth, ids, args, holders, sorted_above, &i, out);
        }
        else if (rc == 0) {
            Py_DECREF(level);
            break;
        }
        Py_XDECREF(level);
    }
    if (rc != 0) {
        Py_DECREF(out);
        if (rc < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    /* out[:holders] (the last run may run past it; holders <= 0 draws nothing) */
    PyObject *drawn = PyList_SetSlice(out, holders > 0 ? holders : 0, PY_SSIZE_T_MAX, NULL) < 0 ? NULL
                                                                                                : PyList_AsTuple(out);
    Py_DECREF(out);
    return drawn;
}

#include "raised_levels.h"

static PyMethodDef methods[] = {
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL,
     "rank(peers, sampled, home, drawn, n, bs, prompt, usable, common, uncached_weight, holders, allowance, slack, "
     "tiebreak, fill_empty, tiered, pulls, constants) -> p2p's ranking, or None off its common path"},
    {"complete", (PyCFunction)(void (*)(void))complete, METH_FASTCALL,
     "complete(ranked, alive, self_id) -> ranked + the alive ids not in it, or None"},
    {"draw_by_depth", (PyCFunction)(void (*)(void))draw_by_depth, METH_FASTCALL,
     "draw_by_depth(levels, n_blocks, tiebreak, exclude, alive, holders, sorted_alive, sorted_above) -> the holders "
     "types.draw_holders_by_depth draws, or None off its common path"},
    {"raised_levels", (PyCFunction)(void (*)(void))raised_levels, METH_FASTCALL,
     "raised_levels(levels, raised, left, cuts, cut_above) -> estimates.raised_levels' answer, or NotImplemented off "
     "its common path"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_p2p", "The default routing policy's ranking in C (see routing/policies/p2p.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__p2p(void)
{
#define INTERN(var, text)                                  \
    if ((var = PyUnicode_InternFromString(text)) == NULL) { \
        return NULL;                                        \
    }
    INTERN(s_node_id, "node_id");
    INTERN(s_alive, "alive");
    INTERN(s_is_self, "is_self");
    INTERN(s_est_match_blocks, "est_match_blocks");
    INTERN(s_load, "load");
    INTERN(s_in_flight, "in_flight");
    INTERN(s_est_disk_blocks, "est_disk_blocks");
    INTERN(s_est_host_blocks, "est_host_blocks");
    INTERN(s_cached_blocks, "cached_blocks");
    INTERN(s_kv_layout, "kv_layout");
    INTERN(s_link_bytes_per_s, "link_bytes_per_s");
    INTERN(s_running, "running");
    INTERN(s_waiting, "waiting");
    INTERN(s_prefill_backlog_tokens, "prefill_backlog_tokens");
#undef INTERN
    return PyModule_Create(&module_def);
}
