/* p2pnode.routing._speculative: the ingress's speculative index in C (routing/speculative.py: ``DictSpeculativeIndex``
 * is the definition and the fallback; tests/unit/test_speculative.py holds this one to it, operation by operation).
 *
 * Why: every forwarded request records its whole chain (an entry per block: 128 for a 4,096-token prompt) and every
 * decision looks its prompt up. In Python each block is an OrderedDict node, an entry object, a dict of peers and two
 * float objects (~320 bytes; 21 MB at the 65,536-entry bound) and a record costs ~280 ns a block. Here an entry is one
 * 56-byte row (two holders inline), found by linear probing on its 64-bit hash (scripts/bench_speculative.py).
 *
 * Layout and invariants:
 *   - ``entries``: a slab of ``allocated`` rows, ``count`` of them in use, the others on a free list (``next``). The
 *     rows in use form a doubly linked list in record order (``head``: least recently recorded, evicted first), the
 *     OrderedDict's order in the definition.
 *   - An entry's holders are its peers' slots and their expiries, in the order each peer was first recorded there
 *     (the definition's dict order): inline up to INLINE_HOLDERS, else in one heap block of ``capacity`` expiries
 *     then ``capacity`` slots. An entry in use has at least one holder (one left with none is removed).
 *   - ``table``: ``table_capacity`` (a power of two) row indices, -1 empty, linear probing from home(hash); deletion
 *     shifts the rows after it back (no tombstones). count * 2 <= table_capacity.
 *   - Peers are exact str, interned to slots: ``slot_of`` maps a peer to its slot, ``names[slot]`` back, and
 *     ``refs[slot]`` counts the entries holding the slot; a slot whose count falls to 0 is released (reused later), so
 *     the peers known are only those some entry holds.
 *   - Hashes are ints in [0, 2**64) (block hashes: ``record`` raises OverflowError / TypeError for anything else,
 *     before it changes anything); a lookup of any other value finds nothing, as it could never have been recorded.
 *   - Memory follows what is held: the slab and the table shrink (a rebuild in record order) when under an eighth
 *     used, never below MIN_ROWS.
 *   - home(hash): Fibonacci hashing of hash ^ seed, a seed per index: a client that crafts prompts whose block hashes
 *     collide in one table cannot aim them at every ingress's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "structmember.h"

#define INLINE_HOLDERS 2
#define MIN_ROWS 16
#define STACK_HOLDERS 64

typedef struct {
    uint64_t hash;
    double expires_at; /* the latest expiry recorded at this block (never lowered, as in the definition) */
    int32_t prev, next;
    uint32_t count, capacity; /* holders */
    union {
        struct {
            double expires[INLINE_HOLDERS];
            uint32_t slots[INLINE_HOLDERS];
        } in;
        double *heap; /* capacity expiries, then capacity uint32 slots */
    } h;
} Entry;

typedef struct {
    PyObject_HEAD
    double ttl_s;
    Py_ssize_t max_entries;
    Entry *entries;
    Py_ssize_t allocated; /* rows in the slab */
    Py_ssize_t used;      /* rows ever handed out (below it: in use or on the free list) */
    Py_ssize_t count;     /* rows in use */
    int32_t free_row;     /* -1: none */
    int32_t head, tail;   /* record order, -1 when empty */
    int32_t *table;
    Py_ssize_t table_capacity;
    int shift;
    uint64_t seed;
    double latest;       /* the latest expiry recorded */
    int in_expiry_order; /* whether record order is expiry order (``expire``) */
    PyObject *slot_of;   /* dict: peer str -> int slot */
    PyObject **names;    /* slot -> peer str (a reference), NULL when free */
    Py_ssize_t *refs;    /* slot -> entries holding it */
    uint32_t *marks;     /* slot -> stamp (match_all's probes) */
    uint32_t stamp;
    Py_ssize_t slots_allocated;
    Py_ssize_t slots_used; /* slots ever handed out */
    uint32_t *free_slots;  /* a stack of released slots */
    Py_ssize_t n_free_slots;
} SpeculativeIndex;

static inline double *
e_expires(Entry *e)
{
    return e->capacity > INLINE_HOLDERS ? e->h.heap : e->h.in.expires;
}

static inline uint32_t *
e_slots(Entry *e)
{
    return e->capacity > INLINE_HOLDERS ? (uint32_t *)(e->h.heap + e->capacity) : e->h.in.slots;
}

/* Position of ``slot`` among an entry's holders, or -1. Eight at a time without an early exit, so that the compiler
 * can vectorize the compare: an entry of a prompt sent to many peers (a mesh-wide system prompt) holds hundreds. */
static inline Py_ssize_t
find_holder(const uint32_t *slots, uint32_t n, uint32_t slot)
{
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int any = 0;
        for (int k = 0; k < 8; k++) {
            any |= slots[i + k] == slot;
        }
        if (any) {
            break;
        }
    }
    for (; i < n; i++) {
        if (slots[i] == slot) {
            return i;
        }
    }
    return -1;
}

/* --- the hash table ------------------------------------------------------------------------------------------- */

static inline Py_ssize_t
home(const SpeculativeIndex *s, uint64_t hash)
{
    return (Py_ssize_t)(((hash ^ s->seed) * 0x9E3779B97F4A7C15ULL) >> s->shift);
}

static inline int32_t
find_row(const SpeculativeIndex *s, uint64_t hash)
{
    Py_ssize_t mask = s->table_capacity - 1;
    for (Py_ssize_t i = home(s, hash);; i = (i + 1) & mask) {
        int32_t row = s->table[i];
        if (row < 0 || s->entries[row].hash == hash) {
            return row;
        }
    }
}

static void
table_insert(SpeculativeIndex *s, uint64_t hash, int32_t row)
{
    Py_ssize_t mask = s->table_capacity - 1, i = home(s, hash);
    while (s->table[i] >= 0) {
        i = (i + 1) & mask;
    }
    s->table[i] = row;
}

static void
table_remove(SpeculativeIndex *s, uint64_t hash)
{
    Py_ssize_t mask = s->table_capacity - 1, hole = home(s, hash);
    while (s->entries[s->table[hole]].hash != hash) {
        hole = (hole + 1) & mask;
    }
    /* shift back every row after the hole whose home is not between the hole and its place */
    for (Py_ssize_t j = (hole + 1) & mask; s->table[j] >= 0; j = (j + 1) & mask) {
        Py_ssize_t k = home(s, s->entries[s->table[j]].hash);
        if (((j - k) & mask) >= ((j - hole) & mask)) {
            s->table[hole] = s->table[j];
            hole = j;
        }
    }
    s->table[hole] = -1;
}

static int
table_rebuild(SpeculativeIndex *s, Py_ssize_t capacity)
{
    int32_t *table = PyMem_Malloc((size_t)capacity * sizeof(int32_t));
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(table, 0xFF, (size_t)capacity * sizeof(int32_t));
    PyMem_Free(s->table);
    s->table = table;
    s->table_capacity = capacity;
    int bits = 0;
    while (((Py_ssize_t)1 << bits) < capacity) {
        bits++;
    }
    s->shift = 64 - bits;
    for (int32_t row = s->head; row >= 0; row = s->entries[row].next) {
        table_insert(s, s->entries[row].hash, row);
    }
    return 0;
}

/* --- peers' slots --------------------------------------------------------------------------------------------- */

/* ``*array`` reallocated to ``n`` items of ``size`` bytes; -1 with MemoryError set (``*array`` unchanged). */
static int
grow(void **array, Py_ssize_t n, size_t size)
{
    void *grown = PyMem_Realloc(*array, (size_t)n * size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = grown;
    return 0;
}

/* 0 for a peer the index can hold (an exact str); -1 with TypeError set otherwise. */
static int
check_peer(PyObject *peer)
{
    if (PyUnicode_CheckExact(peer)) {
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "peer must be a str, got %.100s", Py_TYPE(peer)->tp_name);
    return -1;
}

/* ``now`` as a double; -1 with an error set where it is not a number. */
static int
read_now(PyObject *arg, double *now)
{
    *now = PyFloat_AsDouble(arg);
    return *now == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The slot of a peer (a new one where ``create``); -1 and no error where it has none; -2 with an error set. */
static Py_ssize_t
slot_for(SpeculativeIndex *s, PyObject *peer, int create)
{
    if (check_peer(peer) < 0) {
        return -2;
    }
    PyObject *found = PyDict_GetItemWithError(s->slot_of, peer);
    if (found != NULL) {
        return PyLong_AsSsize_t(found);
    }
    if (PyErr_Occurred()) {
        return -2;
    }
    if (!create) {
        return -1;
    }
    Py_ssize_t slot;
    if (s->n_free_slots > 0) {
        slot = s->free_slots[--s->n_free_slots];
    }
    else {
        if (s->slots_used == s->slots_allocated) {
            Py_ssize_t n = s->slots_allocated ? s->slots_allocated * 2 : 16;
            if (n > UINT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "too many peers");
                return -2;
            }
            if (grow((void **)&s->names, n, sizeof(PyObject *)) < 0
                || grow((void **)&s->refs, n, sizeof(Py_ssize_t)) < 0
                || grow((void **)&s->marks, n, sizeof(uint32_t)) < 0
                || grow((void **)&s->free_slots, n, sizeof(uint32_t)) < 0) {
                return -2; /* the arrays grown so far keep their items: ``slots_allocated`` is what all hold */
            }
            s->slots_allocated = n;
        }
        slot = s->slots_used++;
    }
    PyObject *key = PyLong_FromSsize_t(slot);
    if (key == NULL || PyDict_SetItem(s->slot_of, peer, key) < 0) {
        Py_XDECREF(key);
        s->free_slots[s->n_free_slots++] = (uint32_t)slot;
        return -2;
    }
    Py_DECREF(key);
    Py_INCREF(peer);
    s->names[slot] = peer;
    s->refs[slot] = 0;
    s->marks[slot] = 0;
    return slot;
}

/* A slot no entry holds any more leaves the peers known. */
static void
release_if_unheld(SpeculativeIndex *s, uint32_t slot)
{
    if (s->refs[slot] != 0 || s->names[slot] == NULL) {
        return;
    }
    PyObject *name = s->names[slot];
    s->names[slot] = NULL;
    if (PyDict_DelItem(s->slot_of, name) < 0) { /* an exact str present in the dict: cannot fail */
        PyErr_Clear();
    }
    Py_DECREF(name);
    s->free_slots[s->n_free_slots++] = slot;
}

/* --- rows ----------------------------------------------------------------------------------------------------- */

static void
unlink_row(SpeculativeIndex *s, int32_t row)
{
    Entry *e = &s->entries[row];
    if (e->prev >= 0) {
        s->entries[e->prev].next = e->next;
    }
    else {
        s->head = e->next;
    }
    if (e->next >= 0) {
        s->entries[e->next].prev = e->prev;
    }
    else {
        s->tail = e->prev;
    }
}

static void
append_row(SpeculativeIndex *s, int32_t row)
{
    Entry *e = &s->entries[row];
    e->prev = s->tail;
    e->next = -1;
    if (s->tail >= 0) {
        s->entries[s->tail].next = row;
    }
    else {
        s->head = row;
    }
    s->tail = row;
}

static void
remove_row(SpeculativeIndex *s, int32_t row)
{
    Entry *e = &s->entries[row];
    table_remove(s, e->hash);
    unlink_row(s, row);
    uint32_t *slots = e_slots(e);
    for (uint32_t i = 0; i < e->count; i++) {
        s->refs[slots[i]]--;
        release_if_unheld(s, slots[i]);
    }
    if (e->capacity > INLINE_HOLDERS) {
        PyMem_Free(e->h.heap);
    }
    e->capacity = 0;
    e->count = 0;
    e->next = s->free_row;
    s->free_row = row;
    s->count--;
}

/* A fresh row (the slab grown if need be), not yet linked or in the table; -1 with an error set. */
static int32_t
new_row(SpeculativeIndex *s)
{
    if (s->free_row >= 0) {
        int32_t row = s->free_row;
        s->free_row = s->entries[row].next;
        return row;
    }
    if (s->used == s->allocated) {
        Py_ssize_t n = s->allocated * 2;
        if (n > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "speculative index too large");
            return -1;
        }
        Entry *entries = PyMem_Realloc(s->entries, (size_t)n * sizeof(Entry));
        if (entries == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->entries = entries;
        s->allocated = n;
    }
    return (int32_t)s->used++;
}

/* The slab and the table rebuilt for ``count`` rows: rows renumbered in record order. */
static int
compact(SpeculativeIndex *s)
{
    Py_ssize_t rows = MIN_ROWS;
    while (rows < s->count * 2) {
        rows *= 2;
    }
    Entry *entries = PyMem_Malloc((size_t)rows * sizeof(Entry));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int32_t n = 0;
    for (int32_t row = s->head; row >= 0; row = s->entries[row].next, n++) {
        entries[n] = s->entries[row];
        entries[n].prev = n - 1;
        entries[n].next = n + 1;
    }
    if (n > 0) {
        entries[n - 1].next = -1;
    }
    PyMem_Free(s->entries);
    s->entries = entries;
    s->allocated = rows;
    s->used = n;
    s->free_row = -1;
    s->head = n > 0 ? 0 : -1;
    s->tail = n - 1;
    return table_rebuild(s, rows * 2 > s->table_capacity ? s->table_capacity : rows * 2);
}

static int
shrink_if_sparse(SpeculativeIndex *s)
{
    if (s->allocated > MIN_ROWS && s->count * 8 < s->allocated) {
        return compact(s);
    }
    return 0;
}

/* --- reading hashes ------------------------------------------------------------------------------------------- */

/* A block hash as a lookup reads it: 1 and ``*out`` for an int in [0, 2**64), 0 for anything else (never recorded). */
static inline int
lookup_hash(PyObject *item, uint64_t *out)
{
    if (!PyLong_Check(item)) {
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(item);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* The row of the hash at ``items[i]``, or -1. */
static inline int32_t
row_at(const SpeculativeIndex *s, PyObject *const *items, Py_ssize_t i)
{
    uint64_t hash;
    return lookup_hash(items[i], &hash) ? find_row(s, hash) : -1;
}

/* --- the type ------------------------------------------------------------------------------------------------- */

static void
SpeculativeIndex_dealloc(SpeculativeIndex *s)
{
    if (s->entries != NULL) {
        for (int32_t row = s->head; row >= 0; row = s->entries[row].next) {
            if (s->entries[row].capacity > INLINE_HOLDERS) {
                PyMem_Free(s->entries[row].h.heap);
            }
        }
    }
    for (Py_ssize_t i = 0; i < s->slots_used; i++) {
        Py_XDECREF(s->names[i]);
    }
    PyMem_Free(s->entries);
    PyMem_Free(s->table);
    PyMem_Free(s->names);
    PyMem_Free(s->refs);
    PyMem_Free(s->marks);
    PyMem_Free(s->free_slots);
    Py_XDECREF(s->slot_of);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
SpeculativeIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"ttl_s", "max_entries", NULL};
    double ttl_s;
    Py_ssize_t max_entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "dn", keywords, &ttl_s, &max_entries)) {
        return NULL;
    }
    if (!isfinite(ttl_s) || max_entries < 0 || max_entries > INT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "ttl_s must be finite and max_entries in [0, 2**29)");
        return NULL;
    }
    SpeculativeIndex *s = (SpeculativeIndex *)type->tp_alloc(type, 0);
    if (s == NULL) {
        return NULL;
    }
    s->ttl_s = ttl_s;
    s->max_entries = max_entries;
    s->free_row = s->head = s->tail = -1;
    s->latest = -INFINITY;
    s->in_expiry_order = 1;
    static uint64_t made = 0;
    uint64_t z = (uint64_t)(uintptr_t)s ^ (++made * 0x9E3779B97F4A7C15ULL); /* the address: ASLR's randomness */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    s->seed = z ^ (z >> 31);
    s->slot_of = PyDict_New();
    s->entries = PyMem_Malloc(MIN_ROWS * sizeof(Entry));
    if (s->slot_of == NULL || s->entries == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    s->allocated = MIN_ROWS;
    if (table_rebuild(s, MIN_ROWS * 2) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static Py_ssize_t
SpeculativeIndex_len(SpeculativeIndex *s)
{
    return s->count;
}

/* record(peer, block_hashes, now) */
static PyObject *
SpeculativeIndex_record(SpeculativeIndex *s, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record(peer, block_hashes, now) takes 3 arguments");
        return NULL;
    }
    double now;
    if (check_peer(args[0]) < 0 || read_now(args[2], &now) < 0) { /* the peer first, as the definition checks it */
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "block_hashes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t stack[256];
    uint64_t *hashes = n <= 256 ? stack : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (hashes == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) { /* every hash read before anything changes */
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "block_hashes[%zd] must be an int, got %.100s", i,
                         Py_TYPE(items[i])->tp_name);
            goto done;
        }
        hashes[i] = PyLong_AsUnsignedLongLong(items[i]);
        if (hashes[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_OverflowError, "block_hashes[%zd] must be in [0, 2**64)", i);
            goto done;
        }
    }
    Py_ssize_t found = slot_for(s, args[0], 1);
    if (found < 0) {
        goto done;
    }
    uint32_t slot = (uint32_t)found;
    double expires = now + s->ttl_s;
    if (expires < s->latest) {
        s->in_expiry_order = 0; /* an earlier expiry than one recorded before: ``expire`` scans them all */
    }
    else {
        s->latest = expires;
    }
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* deepest first: shallow blocks are evicted last */
        int32_t row = find_row(s, hashes[i]);
        if (row < 0) {
            if ((s->count + 1) * 2 > s->table_capacity && table_rebuild(s, s->table_capacity * 2) < 0) {
                goto evict;
            }
            row = new_row(s);
            if (row < 0) {
                goto evict;
            }
            Entry *e = &s->entries[row];
            e->hash = hashes[i];
            e->expires_at = expires;
            e->count = 1;
            e->capacity = INLINE_HOLDERS;
            e->h.in.expires[0] = expires;
            e->h.in.slots[0] = slot;
            append_row(s, row);
            table_insert(s, hashes[i], row);
            s->count++;
            s->refs[slot]++;
            continue;
        }
        if (row != s->tail) {
            unlink_row(s, row);
            append_row(s, row);
        }
        Entry *e = &s->entries[row];
        Py_ssize_t at = find_holder(e_slots(e), e->count, slot);
        if (at < 0) {
            if (e->count == e->capacity) { /* grow the holders: one heap block, expiries then slots */
                uint32_t capacity = e->capacity * 2;
                double *heap = PyMem_Malloc((size_t)capacity * (sizeof(double) + sizeof(uint32_t)));
                if (heap == NULL) {
                    PyErr_NoMemory();
                    goto evict;
                }
                memcpy(heap, e_expires(e), e->count * sizeof(double));
                memcpy(heap + capacity, e_slots(e), e->count * sizeof(uint32_t));
                if (e->capacity > INLINE_HOLDERS) {
                    PyMem_Free(e->h.heap);
                }
                e->h.heap = heap;
                e->capacity = capacity;
            }
            at = e->count++;
            e_slots(e)[at] = slot;
            s->refs[slot]++;
        }
        e_expires(e)[at] = expires;
        if (expires > e->expires_at) {
            e->expires_at = expires;
        }
    }
    result = Py_None;
evict: /* the size bound holds on the way out, an error's too */
    while (s->count > s->max_entries) {
        remove_row(s, s->head);
    }
    release_if_unheld(s, slot); /* an empty chain, or a peer whose blocks were all evicted */
    if (result != NULL && shrink_if_sparse(s) < 0) {
        result = NULL;
    }
    Py_XINCREF(result);
done:
    if (hashes != stack) {
        PyMem_Free(hashes);
    }
    Py_DECREF(seq);
    return result;
}

static inline int
holds(Entry *e, uint32_t slot, double now)
{
    Py_ssize_t at = find_holder(e_slots(e), e->count, slot);
    return at >= 0 && e_expires(e)[at] > now;
}

/* Deepest d in [lo, hi] with items[d - 1] held by ``slot``, given that depth lo is (the definition's ``_depth``). */
static Py_ssize_t
depth_of(SpeculativeIndex *s, uint32_t slot, PyObject *const *items, Py_ssize_t lo, Py_ssize_t hi, double now)
{
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        int32_t row = row_at(s, items, mid - 1);
        if (row >= 0 && holds(&s->entries[row], slot, now)) {
            lo = mid;
        }
        else {
            hi = mid - 1;
        }
    }
    return lo;
}

/* match_blocks(peer, block_hashes, now) -> int */
static PyObject *
SpeculativeIndex_match_blocks(SpeculativeIndex *s, PyObject *const *args, Py_ssize_t nargs)
{
    double now;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "match_blocks(peer, block_hashes, now) takes 3 arguments");
        return NULL;
    }
    if (read_now(args[2], &now) < 0) {
        return NULL;
    }
    Py_ssize_t slot = slot_for(s, args[0], 0);
    if (slot == -2) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "block_hashes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int32_t row = n > 0 && slot >= 0 ? row_at(s, items, 0) : -1;
    if (row >= 0 && holds(&s->entries[row], (uint32_t)slot, now)) {
        depth = depth_of(s, (uint32_t)slot, items, 1, n, now);
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(depth);
}

/* The grouped searches of match_all: the holders ``group[0..k)`` are held at ``lo`` and not known beyond it up to
 * ``hi``; peers answering a probe alike share the next one. Each peer's probes are those of its own binary search. */
static void
search_together(SpeculativeIndex *s, PyObject *const *items, double now, Py_ssize_t lo, Py_ssize_t hi,
                Py_ssize_t *group, Py_ssize_t k, const uint32_t *slots, Py_ssize_t *depths)
{
    while (k > 0) {
        if (lo >= hi) {
            for (Py_ssize_t i = 0; i < k; i++) {
                depths[group[i]] = lo;
            }
            return;
        }
        Py_ssize_t mid = (lo + hi + 1) / 2, deeper = 0;
        int32_t row = row_at(s, items, mid - 1);
        if (row >= 0) {
            Entry *e = &s->entries[row];
            if (++s->stamp == 0) { /* wrapped: no mark may look current */
                memset(s->marks, 0, (size_t)s->slots_used * sizeof(uint32_t));
                s->stamp = 1;
            }
            const uint32_t *held = e_slots(e);
            const double *expires = e_expires(e);
            for (uint32_t i = 0; i < e->count; i++) {
                if (expires[i] > now) {
                    s->marks[held[i]] = s->stamp;
                }
            }
            for (Py_ssize_t i = 0; i < k; i++) { /* partition: the peers that hold mid first */
                if (s->marks[slots[group[i]]] == s->stamp) {
                    Py_ssize_t t = group[i];
                    group[i] = group[deeper];
                    group[deeper++] = t;
                }
            }
        }
        search_together(s, items, now, mid, hi, group, deeper, slots, depths);
        group += deeper;
        k -= deeper;
        hi = mid - 1;
    }
}

/* match_all(block_hashes, now) -> {peer: depth} */
static PyObject *
SpeculativeIndex_match_all(SpeculativeIndex *s, PyObject *const *args, Py_ssize_t nargs)
{
    double now;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match_all(block_hashes, now) takes 2 arguments");
        return NULL;
    }
    if (read_now(args[1], &now) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "block_hashes must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *result = PyDict_New();
    int32_t first = n > 0 ? row_at(s, items, 0) : -1;
    if (result == NULL || first < 0) {
        Py_DECREF(seq);
        return result;
    }
    Entry *e = &s->entries[first];
    Py_ssize_t stack_buffer[3 * STACK_HOLDERS];
    uint32_t stack_slots[STACK_HOLDERS];
    Py_ssize_t *buffer = stack_buffer;
    uint32_t *slots = stack_slots;
    if (e->count > STACK_HOLDERS) {
        buffer = PyMem_Malloc((size_t)e->count * 3 * sizeof(Py_ssize_t));
        slots = PyMem_Malloc((size_t)e->count * sizeof(uint32_t));
        if (buffer == NULL || slots == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
    }
    Py_ssize_t *depths = buffer, *group = buffer + e->count;
    Py_ssize_t holders = 0;
    for (uint32_t i = 0; i < e->count; i++) { /* the holders of the first block, in the order they were recorded */
        if (e_expires(e)[i] > now) {
            slots[holders++] = e_slots(e)[i];
        }
    }
    if (holders == 1) {
        depths[0] = depth_of(s, slots[0], items, 1, n, now);
    }
    else if (holders > 1) {
        int32_t last = row_at(s, items, n - 1); /* the whole chain first: a prompt sent again, one probe */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < holders; i++) {
            if (last >= 0 && holds(&s->entries[last], slots[i], now)) {
                depths[i] = n;
            }
            else {
                group[k++] = i;
            }
        }
        search_together(s, items, now, 1, n - 1, group, k, slots, depths);
    }
    for (Py_ssize_t i = 0; i < holders; i++) {
        PyObject *depth = PyLong_FromSsize_t(depths[i]);
        if (depth == NULL || PyDict_SetItem(result, s->names[slots[i]], depth) < 0) {
            Py_XDECREF(depth);
            goto fail;
        }
        Py_DECREF(depth);
    }
    if (buffer != stack_buffer) {
        PyMem_Free(buffer);
        PyMem_Free(slots);
    }
    Py_DECREF(seq);
    return result;
fail:
    if (buffer != stack_buffer) {
        PyMem_Free(buffer);
    }
    if (slots != stack_slots) {
        PyMem_Free(slots);
    }
    Py_DECREF(seq);
    Py_DECREF(result);
    return NULL;
}

static PyObject *
SpeculativeIndex_forget_peer(SpeculativeIndex *s, PyObject *peer)
{
    Py_ssize_t slot = slot_for(s, peer, 0);
    if (slot == -2) {
        return NULL;
    }
    if (slot >= 0) {
        for (int32_t row = s->head, next; row >= 0; row = next) {
            next = s->entries[row].next;
            Entry *e = &s->entries[row];
            Py_ssize_t at = find_holder(e_slots(e), e->count, (uint32_t)slot);
            if (at < 0) {
                continue;
            }
            if (e->count == 1) {
                int last = s->refs[slot] == 1;
                remove_row(s, row); /* releases the slot with its last entry */
                if (last) {
                    break;
                }
                continue;
            }
            e->count--; /* the others keep their order */
            memmove(e_expires(e) + at, e_expires(e) + at + 1, (e->count - at) * sizeof(double));
            memmove(e_slots(e) + at, e_slots(e) + at + 1, (e->count - at) * sizeof(uint32_t));
            if (--s->refs[slot] == 0) {
                release_if_unheld(s, (uint32_t)slot);
                break; /* no other entry holds it */
            }
        }
        if (shrink_if_sparse(s) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* expire(now, front_only=False) -> int: the definition's, row for row. */
static PyObject *
SpeculativeIndex_expire(SpeculativeIndex *s, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"now", "front_only", NULL};
    double now;
    int front_only = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "d|p", keywords, &now, &front_only)) {
        return NULL;
    }
    Py_ssize_t dropped = 0;
    if (s->in_expiry_order) {
        while (s->head >= 0 && !(s->entries[s->head].expires_at > now)) {  /* NaN expires, as in Python */
            remove_row(s, s->head);
            dropped++;
        }
    }
    else if (!front_only) {
        double latest = -INFINITY;
        int ordered = 1;
        for (int32_t row = s->head, next; row >= 0; row = next) {
            next = s->entries[row].next;
            double at = s->entries[row].expires_at;
            if (at <= now) {
                remove_row(s, row);
                dropped++;
            }
            else if (at >= latest) {
                latest = at;
            }
            else {
                ordered = 0;
            }
        }
        if (ordered) {
            s->in_expiry_order = 1;
            s->latest = latest;
        }
    }
    if (dropped && shrink_if_sparse(s) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(dropped);
}

/* entries() -> [(hash, expires_at, {peer: expiry})] in record order (tests and introspection). */
static PyObject *
SpeculativeIndex_entries(SpeculativeIndex *s, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (int32_t row = s->head; row >= 0; row = s->entries[row].next) {
        Entry *e = &s->entries[row];
        PyObject *peers = PyDict_New();
        if (peers == NULL) {
            goto fail;
        }
        for (uint32_t i = 0; i < e->count; i++) {
            PyObject *expiry = PyFloat_FromDouble(e_expires(e)[i]);
            if (expiry == NULL || PyDict_SetItem(peers, s->names[e_slots(e)[i]], expiry) < 0) {
                Py_XDECREF(expiry);
                Py_DECREF(peers);
                goto fail;
            }
            Py_DECREF(expiry);
        }
        PyObject *item = Py_BuildValue("(KdN)", (unsigned long long)e->hash, e->expires_at, peers);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *
SpeculativeIndex_in_expiry_order(SpeculativeIndex *s, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(s->in_expiry_order);
}

static PyObject *
SpeculativeIndex_peers(SpeculativeIndex *s, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(PyDict_GET_SIZE(s->slot_of));
}

static PyObject *
SpeculativeIndex_nbytes(SpeculativeIndex *s, void *Py_UNUSED(closure))
{
    Py_ssize_t per_slot = (Py_ssize_t)(sizeof(PyObject *) + sizeof(Py_ssize_t) + 2 * sizeof(uint32_t));
    Py_ssize_t total = s->allocated * (Py_ssize_t)sizeof(Entry) + s->table_capacity * (Py_ssize_t)sizeof(int32_t) +
                       s->slots_allocated * per_slot;
    for (int32_t row = s->head; row >= 0; row = s->entries[row].next) {
        if (s->entries[row].capacity > INLINE_HOLDERS) {
            total += s->entries[row].capacity * (Py_ssize_t)(sizeof(double) + sizeof(uint32_t));
        }
    }
    return PyLong_FromSsize_t(total);
}

static PyMethodDef SpeculativeIndex_methods[] = {
    {"record", (PyCFunction)(void (*)(void))SpeculativeIndex_record, METH_FASTCALL,
     "record(peer, block_hashes, now): peer will hold every block of this chain once it serves the request."},
    {"match_blocks", (PyCFunction)(void (*)(void))SpeculativeIndex_match_blocks, METH_FASTCALL,
     "match_blocks(peer, block_hashes, now) -> leading blocks of the chain peer is believed to hold now."},
    {"match_all", (PyCFunction)(void (*)(void))SpeculativeIndex_match_all, METH_FASTCALL,
     "match_all(block_hashes, now) -> {peer: match_blocks(peer, ...)} for the peers holding the first block."},
    {"forget_peer", (PyCFunction)SpeculativeIndex_forget_peer, METH_O,
     "forget_peer(peer): drop everything believed about a peer."},
    {"expire", (PyCFunction)(void (*)(void))SpeculativeIndex_expire, METH_VARARGS | METH_KEYWORDS,
     "expire(now, front_only=False) -> the entries dropped (speculative.py says which)."},
    {"entries", (PyCFunction)SpeculativeIndex_entries, METH_NOARGS,
     "entries() -> [(hash, expires_at, {peer: expiry})] in record order."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef SpeculativeIndex_members[] = {
    {"ttl_s", T_DOUBLE, offsetof(SpeculativeIndex, ttl_s), READONLY, "how long a record is believed"},
    {"max_entries", T_PYSSIZET, offsetof(SpeculativeIndex, max_entries), READONLY, "the most block hashes held"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef SpeculativeIndex_getset[] = {
    {"in_expiry_order", (getter)SpeculativeIndex_in_expiry_order, NULL,
     "whether the record order is the expiry order (expire reads only the front)", NULL},
    {"peers", (getter)SpeculativeIndex_peers, NULL, "the peers some entry holds", NULL},
    {"nbytes", (getter)SpeculativeIndex_nbytes, NULL, "bytes held: rows, table, holders and peer slots", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods SpeculativeIndex_as_sequence = {
    .sq_length = (lenfunc)SpeculativeIndex_len,
};

static PyTypeObject SpeculativeIndex_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "p2pnode.routing._speculative.SpeculativeIndex",
    .tp_basicsize = sizeof(SpeculativeIndex),
    .tp_dealloc = (destructor)SpeculativeIndex_dealloc,
    .tp_as_sequence = &SpeculativeIndex_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Block hash -> peers believed to hold it (until their expiry); routing/speculative.py is the definition.",
    .tp_methods = SpeculativeIndex_methods,
    .tp_members = SpeculativeIndex_members,
    .tp_getset = SpeculativeIndex_getset,
    .tp_new = SpeculativeIndex_new,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_speculative", "The ingress's speculative index in C (see routing/speculative.py).", -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__speculative(void)
{
    if (PyType_Ready(&SpeculativeIndex_Type) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL &&
        PyModule_AddObjectRef(module, "SpeculativeIndex", (PyObject *)&SpeculativeIndex_Type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
