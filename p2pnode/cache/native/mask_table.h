/* MaskTable: the peers' summaries as one flat table, summary key -> bitmask of the peer slots publishing it
 * (routing/mask_table.py is the definition and the fallback; included by chain.c, which reads it in deepest_in).
 *
 * Why: a routing decision probes this index ~2 times per sampled depth of the request. As a dict of int keys and int
 * bitmasks each probe reads the dict's index slot, its entry, the key object and the bitmask object: ~3-4 cache misses
 * once a mesh's many prompts outgrow the CPU's caches. Here a row is its 32-bit key beside its bitmask's first machine
 * word, found by linear probing: a probe reads one row, and a mesh of up to 64 peers needs nothing else.
 *
 * Layout and invariants:
 *   - ``rows``: ``capacity`` (a power of two, >= MIN_CAPACITY) rows of 2 words (``width`` 1) or 3 (wider). Word 0
 *     is the key with OCCUPIED set (0: an empty row); word 1 the bitmask's first word (slots 0-63); word 2, where
 *     ``width`` > 1, the index of the key's row in ``arena``.
 *   - ``arena`` (``width`` > 1 only): ``count`` rows in use of ``width`` words, densely packed: word 0 the key's tag
 *     (as its row's word 0), words 1..width-1 the bitmask's further words (slot s at bit s % 64 of word s / 64).
 *     Dense so that wide masks cost their width per key, not per row of a half-empty table; a row removed from the
 *     middle takes the last one's place (its key's row re-pointed).
 *   - Every key's mask has a bit set: a key whose last bit is cleared leaves the table.
 *   - Linear probing from home(key); deletion shifts the rows after it back (no tombstones), so a key is always found
 *     before the first empty row after its home.
 *   - count * 2 <= capacity (grown x2 past it); shrunk /2 when count * 8 < capacity, never below MIN_CAPACITY.
 *   - ``width`` grows (the table rebuilt) to hold the highest slot ever set; it never shrinks.
 *   - home(key): Fibonacci hashing of key ^ seed, a seed per table: a peer that publishes keys chosen to collide
 *     cannot aim them at every node's table.
 */

#define MASK_TABLE_OCCUPIED (1ULL << 32)
#define MASK_TABLE_MIN_CAPACITY 16
/* The most slots a bitmask may name: far past the gossip's member cap (1,024); a guard against a slot that would
 * make every key thousands of words wide. */
#define MASK_TABLE_MAX_SLOTS (1 << 16)

typedef struct {
    PyObject_HEAD
    uint64_t *rows;
    Py_ssize_t capacity;
    Py_ssize_t count;
    Py_ssize_t width; /* words of bitmask per key */
    int shift;        /* 64 - log2(capacity) */
    uint64_t seed;
    uint64_t *arena; /* width > 1: count rows in use of width words; NULL otherwise */
    Py_ssize_t arena_capacity;
} MaskTable;

static PyTypeObject MaskTable_Type;

static inline Py_ssize_t
mt_row_words(Py_ssize_t width)
{
    return width == 1 ? 2 : 3;
}

static inline uint64_t *
mt_row(const MaskTable *t, Py_ssize_t i)
{
    return t->rows + i * mt_row_words(t->width);
}

/* Word ``i`` (< width) of an occupied row's bitmask. */
static inline uint64_t *
mt_word(const MaskTable *t, const uint64_t *row, Py_ssize_t i)
{
    return i == 0 ? (uint64_t *)row + 1 : t->arena + (Py_ssize_t)row[2] * t->width + i;
}

/* The first ``count`` 64-bit words of an occupied row's bitmask into ``into`` (zeros past the table's width; copied
 * byte-wise, so a caller's buffer of another 64-bit word type is read back safely). */
static inline void
mt_copy_words(const MaskTable *t, const uint64_t *row, void *into, Py_ssize_t count)
{
    unsigned char *to = into;
    Py_ssize_t have = t->width < count ? t->width : count;
    if (have > 0) {
        memcpy(to, row + 1, sizeof(uint64_t));
    }
    if (have > 1) { /* the further words, side by side in the arena */
        memcpy(to + sizeof(uint64_t), mt_word(t, row, 1), (size_t)(have - 1) * sizeof(uint64_t));
    }
    if (count > have) {
        memset(to + (size_t)have * sizeof(uint64_t), 0, (size_t)(count - have) * sizeof(uint64_t));
    }
}

static inline Py_ssize_t
mt_home(const MaskTable *t, uint32_t key)
{
    return (Py_ssize_t)((((uint64_t)key ^ t->seed) * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

/* The row holding ``key``, or NULL. */
static inline const uint64_t *
mt_find(const MaskTable *t, uint32_t key)
{
    Py_ssize_t mask = t->capacity - 1;
    uint64_t want = (uint64_t)key | MASK_TABLE_OCCUPIED;
    for (Py_ssize_t i = mt_home(t, key);; i = (i + 1) & mask) {
        const uint64_t *row = mt_row(t, i);
        if (row[0] == want) {
            return row;
        }
        if (row[0] == 0) {
            return NULL;
        }
    }
}

static int
mt_log2(Py_ssize_t capacity)
{
    int log = 0;
    while (((Py_ssize_t)1 << log) < capacity) {
        log++;
    }
    return log;
}

static void *
mt_calloc(Py_ssize_t items, Py_ssize_t words)
{
    if (items > 0 && (size_t)words > PY_SSIZE_T_MAX / sizeof(uint64_t) / (size_t)items) {
        return PyErr_NoMemory();
    }
    void *at = PyMem_Calloc((size_t)(items * words), sizeof(uint64_t));
    return at != NULL ? at : PyErr_NoMemory();
}

/* The table laid out anew in ``capacity`` rows of a ``width``-word bitmask (at least the current count's and width's
 * needs), its arena packed. 0, or -1 with MemoryError (the table unchanged). */
static int
mt_rebuild(MaskTable *t, Py_ssize_t capacity, Py_ssize_t width)
{
    MaskTable fresh = *t;
    fresh.capacity = capacity;
    fresh.width = width;
    fresh.shift = 64 - mt_log2(capacity);
    fresh.arena = NULL;
    fresh.arena_capacity = 0;
    fresh.rows = mt_calloc(capacity, mt_row_words(width));
    if (fresh.rows == NULL) {
        return -1;
    }
    if (width > 1) {
        fresh.arena_capacity = t->count > MASK_TABLE_MIN_CAPACITY ? t->count : MASK_TABLE_MIN_CAPACITY;
        if ((fresh.arena = mt_calloc(fresh.arena_capacity, width)) == NULL) {
            PyMem_Free(fresh.rows);
            return -1;
        }
    }
    Py_ssize_t packed = 0;
    for (Py_ssize_t i = 0; t->rows != NULL && i < t->capacity; i++) {
        const uint64_t *old = mt_row(t, i);
        if (old[0] == 0) {
            continue;
        }
        Py_ssize_t j = mt_home(&fresh, (uint32_t)old[0]);
        while (mt_row(&fresh, j)[0] != 0) {
            j = (j + 1) & (capacity - 1);
        }
        uint64_t *row = mt_row(&fresh, j);
        row[0] = old[0];
        row[1] = old[1];
        if (width > 1) {
            row[2] = (uint64_t)packed;
            uint64_t *to = fresh.arena + packed++ * width;
            to[0] = old[0];
            for (Py_ssize_t w = 1; w < t->width; w++) {
                to[w] = *mt_word(t, old, w);
            }
        }
    }
    PyMem_Free(t->rows);
    PyMem_Free(t->arena);
    *t = fresh;
    return 0;
}

/* The row of ``key``, inserted (its mask all zero) when absent; NULL with MemoryError. */
static uint64_t *
mt_insert(MaskTable *t, uint32_t key)
{
    uint64_t *row = (uint64_t *)mt_find(t, key);
    if (row != NULL) {
        return row;
    }
    if ((t->count + 1) * 2 > t->capacity && mt_rebuild(t, t->capacity * 2, t->width) < 0) {
        return NULL;
    }
    if (t->width > 1 && t->count == t->arena_capacity) {
        uint64_t *arena = PyMem_Realloc(t->arena, (size_t)(2 * t->arena_capacity * t->width) * sizeof(uint64_t));
        if (arena == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        t->arena = arena;
        t->arena_capacity *= 2;
    }
    Py_ssize_t i = mt_home(t, key);
    while (mt_row(t, i)[0] != 0) {
        i = (i + 1) & (t->capacity - 1);
    }
    row = mt_row(t, i);
    row[0] = (uint64_t)key | MASK_TABLE_OCCUPIED;
    row[1] = 0;
    if (t->width > 1) {
        uint64_t *packed = t->arena + t->count * t->width;
        memset(packed, 0, (size_t)t->width * sizeof(uint64_t));
        packed[0] = row[0];
        row[2] = (uint64_t)t->count;
    }
    t->count++;
    return row;
}

/* Removes the occupied ``row``: its arena row takes the last one (re-pointed), then the rows of its run that may
 * move are shifted back; a sparse table shrinks (a failed shrink leaves it as it is: only larger than need be). */
static void
mt_remove(MaskTable *t, uint64_t *row)
{
    if (t->width > 1) {
        Py_ssize_t at = (Py_ssize_t)row[2], last = t->count - 1;
        if (at != last) {
            uint64_t *to = t->arena + at * t->width, *from = t->arena + last * t->width;
            memcpy(to, from, (size_t)t->width * sizeof(uint64_t));
            ((uint64_t *)mt_find(t, (uint32_t)to[0]))[2] = (uint64_t)at;
        }
    }
    Py_ssize_t mask = t->capacity - 1, words = mt_row_words(t->width);
    Py_ssize_t i = (row - t->rows) / words;
    for (Py_ssize_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        uint64_t *next = mt_row(t, j);
        if (next[0] == 0) {
            break;
        }
        Py_ssize_t home = mt_home(t, (uint32_t)next[0]);
        /* the row at j may fill the gap at i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            memcpy(mt_row(t, i), next, (size_t)words * sizeof(uint64_t));
            i = j;
        }
    }
    memset(mt_row(t, i), 0, (size_t)words * sizeof(uint64_t));
    t->count--;
    int sparse_rows = t->count * 8 < t->capacity && t->capacity > MASK_TABLE_MIN_CAPACITY;
    int sparse_arena = t->count * 8 < t->arena_capacity && t->arena_capacity > MASK_TABLE_MIN_CAPACITY;
    if ((sparse_rows || sparse_arena) && mt_rebuild(t, sparse_rows ? t->capacity / 2 : t->capacity, t->width) < 0) {
        PyErr_Clear();
    }
}

/* A key argument: an int in [0, 2**32). 0, or -1 with OverflowError / TypeError naming it. */
static int
mt_key(PyObject *obj, uint32_t *key)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a summary key must be an int, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        value = 1ULL << 32; /* negative or past 64 bits: out of range below */
    }
    if (value >> 32) {
        PyErr_SetString(PyExc_OverflowError, "a summary key must be in [0, 2**32)");
        return -1;
    }
    *key = (uint32_t)value;
    return 0;
}

/* A slot argument: an int in [0, MASK_TABLE_MAX_SLOTS). */
static int
mt_slot(PyObject *obj, Py_ssize_t *slot)
{
    Py_ssize_t value = PyLong_Check(obj) ? PyLong_AsSsize_t(obj) : -1;
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    if (!PyLong_Check(obj) || value < 0 || value >= MASK_TABLE_MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "a slot must be an int in [0, %d)", MASK_TABLE_MAX_SLOTS);
        return -1;
    }
    *slot = value;
    return 0;
}

/* ``count`` little-endian machine words as a non-negative Python int. */
static PyObject *
mt_words_int(const uint64_t *words, Py_ssize_t count)
{
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "MaskTable reads its words as little-endian bytes"
#endif
#if PY_VERSION_HEX < 0x030D0000
    return _PyLong_FromByteArray((const unsigned char *)words, (size_t)count * sizeof(uint64_t), 1, 0);
#else
    return PyLong_FromUnsignedNativeBytes(words, (size_t)count * sizeof(uint64_t), Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#endif
}

/* A row's mask as a Python int. */
static PyObject *
mt_mask_int(const MaskTable *t, const uint64_t *row)
{
    if (t->width == 1) {
        return mt_words_int(row + 1, 1);
    }
    uint64_t small[16] = {0}, *words = small;
    if (t->width > 16 && (words = PyMem_Malloc((size_t)t->width * sizeof(uint64_t))) == NULL) {
        return PyErr_NoMemory();
    }
    mt_copy_words(t, row, words, t->width);
    PyObject *out = mt_words_int(words, t->width);
    if (words != small) {
        PyMem_Free(words);
    }
    return out;
}

static PyObject *
MaskTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "MaskTable() takes no arguments");
        return NULL;
    }
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    static uint64_t tables = 0;
    uint64_t z = (uint64_t)(uintptr_t)t ^ (++tables * 0x9E3779B97F4A7C15ULL); /* the address: ASLR's randomness */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    t->seed = (z ^ (z >> 27)) & 0xFFFFFFFFULL;
    if (mt_rebuild(t, MASK_TABLE_MIN_CAPACITY, 1) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void
MaskTable_dealloc(MaskTable *t)
{
    PyMem_Free(t->rows);
    PyMem_Free(t->arena);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
MaskTable_len(MaskTable *t)
{
    return t->count;
}

static int
MaskTable_contains(MaskTable *t, PyObject *obj)
{
    uint32_t key;
    if (mt_key(obj, &key) < 0) {
        PyErr_Clear(); /* not a summary key: not in the table, as a dict answers */
        return 0;
    }
    return mt_find(t, key) != NULL;
}

static PyObject *
MaskTable_subscript(MaskTable *t, PyObject *obj)
{
    uint32_t key;
    const uint64_t *row = mt_key(obj, &key) < 0 ? NULL : mt_find(t, key);
    if (row == NULL) {
        PyErr_Clear();
        PyErr_SetObject(PyExc_KeyError, obj);
        return NULL;
    }
    return mt_mask_int(t, row);
}

static PyObject *
MaskTable_get(MaskTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=0)");
        return NULL;
    }
    uint32_t key;
    const uint64_t *row = NULL;
    if (mt_key(args[0], &key) == 0) {
        row = mt_find(t, key);
    }
    else {
        PyErr_Clear();
    }
    if (row != NULL) {
        return mt_mask_int(t, row);
    }
    return nargs == 2 ? Py_NewRef(args[1]) : PyLong_FromLong(0);
}

/* set (set=1) or clear (set=0) ``slot``'s bit of ``key``'s mask. */
static int
mt_change(MaskTable *t, uint32_t key, Py_ssize_t slot, int set)
{
    Py_ssize_t word = slot / 64;
    uint64_t bit = 1ULL << (slot % 64);
    if (!set) {
        uint64_t *row = (uint64_t *)mt_find(t, key);
        if (row == NULL || word >= t->width || !(*mt_word(t, row, word) & bit)) {
            return 0;
        }
        *mt_word(t, row, word) &= ~bit;
        for (Py_ssize_t w = 0; w < t->width; w++) {
            if (*mt_word(t, row, w)) {
                return 0;
            }
        }
        mt_remove(t, row);
        return 0;
    }
    if (word >= t->width) {
        Py_ssize_t width = t->width;
        while (width <= word) {
            width *= 2;
        }
        if (mt_rebuild(t, t->capacity, width) < 0) {
            return -1;
        }
    }
    uint64_t *row = mt_insert(t, key);
    if (row == NULL) {
        return -1;
    }
    *mt_word(t, row, word) |= bit;
    return 0;
}

/* set_bits / clear_bits: ``slot``'s bit set or cleared for every key of an iterable (checked as it goes: the keys
 * before a bad one are applied). */
static PyObject *
mt_change_all(MaskTable *t, PyObject *const *args, Py_ssize_t nargs, int set, const char *usage)
{
    Py_ssize_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (mt_slot(args[1], &slot) < 0) {
        return NULL;
    }
    PyObject *iter = PyObject_GetIter(args[0]);
    if (iter == NULL) {
        return NULL;
    }
    PyObject *item;
    uint32_t key;
    while ((item = PyIter_Next(iter)) != NULL) {
        int rc = mt_key(item, &key) < 0 ? -1 : mt_change(t, key, slot, set);
        Py_DECREF(item);
        if (rc < 0) {
            Py_DECREF(iter);
            return NULL;
        }
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
MaskTable_set_bits(MaskTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    return mt_change_all(t, args, nargs, 1, "set_bits(keys, slot)");
}

static PyObject *
MaskTable_clear_bits(MaskTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    return mt_change_all(t, args, nargs, 0, "clear_bits(keys, slot)");
}

static PyObject *
MaskTable_items(MaskTable *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < t->capacity; i++) {
        /* re-read each time, and appended: an allocation below may run a finaliser that changes the table */
        const uint64_t *row = mt_row(t, i);
        if (row[0] == 0) {
            continue;
        }
        PyObject *mask = mt_mask_int(t, row);
        PyObject *item = mask == NULL ? NULL : Py_BuildValue("(kN)", (unsigned long)(uint32_t)row[0], mask);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *
MaskTable_nbytes(MaskTable *t, void *Py_UNUSED(closure))
{
    Py_ssize_t words = t->capacity * mt_row_words(t->width) + t->arena_capacity * t->width;
    return PyLong_FromSsize_t(words * (Py_ssize_t)sizeof(uint64_t));
}

static PyObject *
MaskTable_width(MaskTable *t, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(t->width);
}

static PyMethodDef MaskTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))MaskTable_get, METH_FASTCALL,
     "get(key, default=0) -> the bitmask of the slots publishing key"},
    {"set_bits", (PyCFunction)(void (*)(void))MaskTable_set_bits, METH_FASTCALL,
     "set_bits(keys, slot): slot publishes every key of keys"},
    {"clear_bits", (PyCFunction)(void (*)(void))MaskTable_clear_bits, METH_FASTCALL,
     "clear_bits(keys, slot): slot publishes none of keys (a key no slot publishes leaves the table)"},
    {"items", (PyCFunction)MaskTable_items, METH_NOARGS, "items() -> [(key, bitmask)], in no particular order"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef MaskTable_getset[] = {
    {"nbytes", (getter)MaskTable_nbytes, NULL, "bytes of the table's rows and arena", NULL},
    {"width", (getter)MaskTable_width, NULL, "64-bit words per bitmask (grows with the highest slot set)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods MaskTable_as_sequence = {
    .sq_contains = (objobjproc)MaskTable_contains,
};

static PyMappingMethods MaskTable_as_mapping = {
    .mp_length = (lenfunc)MaskTable_len,
    .mp_subscript = (binaryfunc)MaskTable_subscript,
};

static PyTypeObject MaskTable_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "p2pnode.cache._chain.MaskTable",
    .tp_doc = "summary key -> bitmask of the peer slots publishing it, in one flat table (routing/mask_table.py)",
    .tp_basicsize = sizeof(MaskTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = MaskTable_new,
    .tp_dealloc = (destructor)MaskTable_dealloc,
    .tp_methods = MaskTable_methods,
    .tp_getset = MaskTable_getset,
    .tp_as_sequence = &MaskTable_as_sequence,
    .tp_as_mapping = &MaskTable_as_mapping,
};
