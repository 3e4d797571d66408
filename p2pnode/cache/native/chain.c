/* p2pnode.cache._chain: the block-hash chain of p2pnode/cache/block_hash.py in one C loop, and the prefix matches
 * (against this node's index, and against the peers' summaries).
 *
 * block_hashes() runs on every request's routing path. In Python it costs one list -> uint32 conversion of the
 * whole prompt plus one xxh3 call and one bytes slice per block (~32 us for 4096 tokens); here each token is read
 * straight from the list into a block-sized little-endian buffer and hashed when the block is full. Reading the
 * tokens is most of what is left (4096 of them against 128 hashes), so a block of plain small ints is read in one
 * tight pass (read_block_fast) and anything else falls back to the checked read of one token at a time.
 *
 * Contract (checked against the Python definition by tests/unit/test_block_hash.py):
 *   chain(tokens: list[int], block_size: int, seed: int) -> list[int]
 *   h_0 = xxh3_64(le_u32(tokens[0:B]), seed), h_i = xxh3_64(le_u32(tokens[i*B:(i+1)*B]), h_{i-1});
 *   a trailing partial block is ignored but its tokens are still checked;
 *   a token outside [0, 2**32) raises ValueError, a non-integer TypeError (the same errors as the Python path).
 *   chain(tokens: bytes, block_size, seed): the same of tokens already as le_u32 bytes (``block_hashes_packed``: a
 *   client's token ids as admission keeps them from the wire), one xxh3 call per block and no token read; a length
 *   that is not whole uint32s raises ValueError.
 *
 *   leading_in(hashes: list | tuple, present: dict | set | frozenset) -> int
 *   how many of the first items of ``hashes`` are keys (members) of ``present``, up to the first that is not: a prefix
 *   index's match. The same count as len(list(takewhile(present.__contains__, hashes))), without a Python call per
 *   item (~2.5 -> ~0.7 us for a 64-block match).
 *
 *   deepest_in(hashes, groups, inverted, ids_of, levels=None, known=None, depths=None, slot_ids=None)
 *     -> dict[str, int]
 *   routing/tier_summaries.py's deepest_published, step for step (its Python is the definition, and the fallback):
 *   for each (stride, mask) of ``groups``, from the deepest depth that is a multiple of the stride down, the peers of
 *   ``inverted.get(key(hashes[depth - 1])) & inverted.get(key(hashes[depth - stride - 1])) & remaining`` (the second
 *   factor past the first stride only; key: the low 32 bits, a summary key) get that depth, leave ``remaining`` and
 *   are appended to ``levels`` as ``(depth, ids)``; ids are ``known.get(hit)`` or else ``ids_of(hit)`` -- or, with
 *   ``slot_ids`` (each slot's node id), for a hit of at most DECODE_AT_MOST (16) peers, its ids decoded from
 *   ``slot_ids`` as ``ids_of_mask`` does (no Python call, no int made of a 64-bit hit). At 1,000
 *   peers that each match, the answer is a 1,000-entry dict: Python's loop writing it was most of a routing decision.
 *   With ``depths`` (a writable buffer of 4-byte unsigned items, one per peer slot: an ``array('I')``): every level's
 *   depth is written at the slots of its bitmask instead (bit i: slot i), a pass over its set bits in machine words,
 *   and the dict is left empty (the caller reads each estimate by its slot, routing/estimates.py); a bit past the
 *   buffer raises ValueError. ``inverted`` is a dict (int bitmasks) or a MaskTable (mask_table.h: the view's index,
 *   read in place with no int made of a probe; a group's negative mask then raises ValueError).
 *
 *   ids_of_mask(mask: int, slot_ids: list) -> tuple[str, ...]
 *   routing/cluster_view.py's ``ClusterView._ids_of`` decoding: the node ids at the set bits of a non-negative
 *   bitmask, lowest slot first (bit i: ``slot_ids[i]``, a str); a bit past the list raises IndexError, one at a free
 *   slot (not a str) TypeError. A level of a request's estimates is decoded once per new bitmask: bit by bit in
 *   Python that is ~0.1 us a peer (~3 us for a level of 30 peers), most of a decision over a prompt seen first.
 *
 *   mix64(h: int) -> int
 *   block_hash.mix64 (splitmix64's finaliser of h modulo 2**64): twice a decision (the sample, the home), ~0.5 us
 *   each in Python's big-int arithmetic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#include "read_token.h"
#include "mask_table.h"

/* A whole block of exact ints of at most one digit (every token id below 2**30), read without a branch per token on
 * its value: the common case of read_token in one pass. Returns 0 when any item is something else; the caller then
 * reads the block item by item, with read_token's errors. */
static inline int
read_block_fast(PyObject *const *items, Py_ssize_t count, unsigned char *dst)
{
#if PY_VERSION_HEX >= 0x030C0000
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item) || !PyUnstable_Long_IsCompact((PyLongObject *)item)) {
            return 0;
        }
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v < 0 || v > 0xFFFFFFFF) {
            return 0;
        }
        store_le32(dst + 4 * i, (uint32_t)v);
    }
    return 1;
#else
    size_t sizes = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = items[i];
        if (Py_TYPE(item) != &PyLong_Type) {
            return 0;
        }
        size_t size = (size_t)Py_SIZE(item);  /* 0 or 1 here; a negative int's is huge */
        sizes |= size;
        /* every int has a digit allocated, but a zero's may be garbage: times its size (0 or 1), no branch */
        store_le32(dst + 4 * i, (uint32_t)((PyLongObject *)item)->ob_digit[0] * (uint32_t)size);
    }
    return (sizes >> 1) == 0;
#endif
}

/* The chain of tokens already in the hash's byte form (4 little-endian bytes each, as token_wire.unpack keeps them):
 * no token to read or check, one xxh3 call per block. */
static PyObject *
chain_packed(PyObject *tokens, Py_ssize_t block_size, XXH64_hash_t h)
{
    Py_ssize_t size = PyBytes_GET_SIZE(tokens);
    if (size % 4) {
        PyErr_Format(PyExc_ValueError, "packed tokens must be whole uint32s, got %zd bytes", size);
        return NULL;
    }
    Py_ssize_t blocks = (size / 4) / block_size;  /* never block_size * 4 first: it wraps past 2**62 */
    size_t stride = blocks > 0 ? (size_t)block_size * 4 : 0;  /* then block_size * 4 <= size: no wrap */
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(tokens);
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t b = 0; b < blocks; b++) {
        h = XXH3_64bits_withSeed(data + (size_t)b * stride, stride, h);
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, value);
    }
    return out;
}

static PyObject *
chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "chain(tokens: list, block_size: int, seed: int)");
        return NULL;
    }
    PyObject *tokens = args[0];
    int packed = PyBytes_CheckExact(tokens);
    if (!packed && !PyList_Check(tokens)) {
        PyErr_SetString(PyExc_TypeError, "tokens must be a list or bytes (packed little-endian uint32s)");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear();  /* an int past Py_ssize_t: a huge block holds no prompt (the Python definition: no block) */
        int positive = PyObject_RichCompareBool(args[1], Py_False, Py_GT);
        if (positive < 0) {
            return NULL;
        }
        if (positive) {
            return PyList_New(0);
        }
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1");
        return NULL;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", block_size);
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (packed) {
        return chain_packed(tokens, block_size, (XXH64_hash_t)seed);
    }
    Py_ssize_t n = PyList_GET_SIZE(tokens);
    Py_ssize_t blocks = n / block_size;
    unsigned char *buf = PyMem_Malloc(blocks > 0 ? (size_t)block_size * 4 : 1);  /* block_size <= n when used */
    PyObject *out = PyList_New(blocks);
    if (buf == NULL || out == NULL) {
        PyMem_Free(buf);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    XXH64_hash_t h = (XXH64_hash_t)seed;
    uint32_t token;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        PyObject **items = PySequence_Fast_ITEMS(tokens) + b * block_size;
        if (!read_block_fast(items, block_size, buf)) {
            for (Py_ssize_t i = 0; i < block_size; i++) {
                if (read_token(items[i], &token) < 0) {
                    goto fail;
                }
                store_le32(buf + 4 * i, token);
            }
        }
        h = XXH3_64bits_withSeed(buf, (size_t)block_size * 4, h);
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, b, value);
    }
    for (Py_ssize_t i = blocks * block_size; i < n; i++) {  /* the partial block: checked, not hashed */
        if (read_token(PyList_GET_ITEM(tokens, i), &token) < 0) {
            goto fail;
        }
    }
    PyMem_Free(buf);
    return out;
fail:
    PyMem_Free(buf);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
leading_in(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leading_in(hashes: list | tuple, present: dict | set)");
        return NULL;
    }
    PyObject *hashes = args[0], *present = args[1];
    if (!PyList_Check(hashes) && !PyTuple_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list or a tuple");
        return NULL;
    }
    /* exact types: a subclass may override __contains__, which PyDict_Contains and PySet_Contains would bypass */
    int is_dict = PyDict_CheckExact(present);
    if (!is_dict && !PyAnySet_CheckExact(present)) {
        PyErr_SetString(PyExc_TypeError, "present must be a dict, a set or a frozenset (not a subclass)");
        return NULL;
    }
    Py_ssize_t i = 0;
    /* PySequence_Fast_* read a list's or a tuple's items in place; the size is re-read each time: an item's __eq__
     * may change the list */
    for (; i < PySequence_Fast_GET_SIZE(hashes); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(hashes, i));
        int found = is_dict ? PyDict_Contains(present, item) : PySet_Contains(present, item);
        Py_DECREF(item);
        if (found < 0) {
            return NULL;
        }
        if (!found) {
            break;
        }
    }
    return PyLong_FromSsize_t(i);
}

/* A dict sized for ``entries`` items at once: a 1,000-peer answer then fills without growing (7 resizes saved). */
static inline PyObject *
new_dict_for(Py_ssize_t entries)
{
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_NewPresized(entries);
#else
    (void)entries;
    return PyDict_New();
#endif
}

/* A non-negative int's bits as little-endian machine words (no conversion of a word at a time in Python). */
typedef struct {
    unsigned long long small[16];
    unsigned long long *at; /* small, or a PyMem block past 1,024 bits */
    size_t count;
} Words;

static void
words_release(Words *w)
{
    if (w->at != w->small) {
        PyMem_Free(w->at);
    }
}

/* 0, or -1 with an exception set (a negative int: ValueError); release with words_release after 0. */
static int
mask_words(PyObject *mask, Words *w)
{
    w->at = w->small;
    w->count = 0;
    if (_PyLong_Sign(mask) < 0) {
        PyErr_SetString(PyExc_ValueError, "a bitmask must not be negative");
        return -1;
    }
    size_t bits = _PyLong_NumBits(mask);
    if (bits == (size_t)-1) {
        return -1;
    }
    w->count = (bits + 63) / 64;
    if (w->count > 16 && (w->at = PyMem_Malloc(w->count * sizeof *w->at)) == NULL) {
        w->at = w->small;
        PyErr_NoMemory();
        return -1;
    }
    if (w->count == 0) {
        return 0;
    }
#if PY_VERSION_HEX < 0x030D0000
    int rc = _PyLong_AsByteArray((PyLongObject *)mask, (unsigned char *)w->at, w->count * sizeof *w->at, 1, 0);
#else
    int rc = PyLong_AsNativeBytes(mask, w->at, w->count * sizeof *w->at,
                                  Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER) < 0 ? -1 : 0;
#endif
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (size_t i = 0; rc == 0 && i < w->count; i++) {
        w->at[i] = __builtin_bswap64(w->at[i]); /* little-endian bytes */
    }
#endif
    if (rc < 0) {
        words_release(w);
        w->at = w->small;
    }
    return rc;
}

static Py_ssize_t
words_popcount(const Words *w)
{
    Py_ssize_t count = 0;
    for (size_t i = 0; i < w->count; i++) {
        count += __builtin_popcountll(w->at[i]);
    }
    return count;
}

/* out[k] = slot_ids[slot]: 0, or -1 with IndexError for a slot past the list, TypeError for one that holds no str. */
static int
put_id(PyObject *out, Py_ssize_t k, PyObject *slot_ids, Py_ssize_t slot)
{
    if (slot >= PyList_GET_SIZE(slot_ids)) {
        PyErr_Format(PyExc_IndexError, "a bitmask sets slot %zd, past the %zd slots", slot, PyList_GET_SIZE(slot_ids));
        return -1;
    }
    PyObject *id = PyList_GET_ITEM(slot_ids, slot);
    if (!PyUnicode_Check(id)) {
        PyErr_Format(PyExc_TypeError, "a bitmask sets slot %zd, which holds no peer", slot);
        return -1;
    }
    PyTuple_SET_ITEM(out, k, Py_NewRef(id));
    return 0;
}

/* The ids at the set bits of ``w``, lowest first, from ``slot_ids`` (a list; a str per slot): a new tuple, or NULL
 * with put_id's errors. */
static PyObject *
ids_at_words(const Words *w, PyObject *slot_ids)
{
    PyObject *out = PyTuple_New(words_popcount(w));
    Py_ssize_t k = 0;
    for (size_t i = 0; out != NULL && i < w->count; i++) {
        for (unsigned long long word = w->at[i]; word; word &= word - 1) {
            if (put_id(out, k++, slot_ids, (Py_ssize_t)(i * 64) + __builtin_ctzll(word)) < 0) {
                Py_CLEAR(out);
                break;
            }
        }
    }
    return out;
}

/* ids_at_words of a non-negative int (ValueError for a negative one), or NULL with no exception set where it sets
 * more than ``limit`` bits. On CPython before 3.12 it is read from the int's own digits (PyLong_SHIFT bits each, least
 * significant first) with no conversion, and the count stops past the limit: a 1,000-peer level's int costs a
 * caller that names only few peers this way next to nothing. */
static PyObject *
ids_of_int(PyObject *mask, PyObject *slot_ids, Py_ssize_t limit)
{
#if PY_VERSION_HEX < 0x030C0000
    if (Py_SIZE(mask) < 0) {
        PyErr_SetString(PyExc_ValueError, "a bitmask must not be negative");
        return NULL;
    }
    const digit *digits = ((PyLongObject *)mask)->ob_digit;
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < Py_SIZE(mask) && count <= limit; i++) {
        count += __builtin_popcount(digits[i]);
    }
    if (count > limit) {
        return NULL;
    }
    PyObject *out = PyTuple_New(count);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; out != NULL && i < Py_SIZE(mask); i++) {
        for (unsigned int word = digits[i]; word; word &= word - 1) {
            if (put_id(out, k++, slot_ids, i * PyLong_SHIFT + __builtin_ctz(word)) < 0) {
                Py_CLEAR(out);
                break;
            }
        }
    }
    return out;
#else
    Words words;
    if (mask_words(mask, &words) < 0) {
        return NULL;
    }
    PyObject *out = words_popcount(&words) <= limit ? ids_at_words(&words, slot_ids) : NULL;
    words_release(&words);
    return out;
#endif
}

/* How a level's bitmask becomes its node ids (``deepest_in``'s known, ids_of and slot_ids). */
typedef struct {
    PyObject *known;    /* borrowed, or NULL */
    PyObject *ids_of;   /* borrowed */
    PyObject *slot_ids; /* borrowed, or NULL */
} Namer;

/* The most peers of a hit decoded from ``slot_ids`` rather than looked up in ``known`` or asked of ``ids_of``: a
 * handful of ids costs less to decode than a Python call, and a level rarely recurs unless many peers share it. */
#define DECODE_AT_MOST 16

static PyObject *ids_named(const Namer *namer, PyObject *hit);

/* The node ids of a hit: decoded from namer->slot_ids where it sets at most DECODE_AT_MOST bits, else
 * known.get(hit), else ids_of(hit), as a list or tuple (a new reference; NULL: an error). */
static PyObject *
ids_of_hit(const Namer *namer, PyObject *hit)
{
    PyObject *ids = NULL;
    if (namer->slot_ids != NULL) {
        if (!PyLong_Check(hit)) {
            PyErr_Format(PyExc_TypeError, "a bitmask must be an int, got %.100s", Py_TYPE(hit)->tp_name);
            return NULL;
        }
        ids = ids_of_int(hit, namer->slot_ids, DECODE_AT_MOST);
        if (ids != NULL || PyErr_Occurred()) {
            return ids; /* few enough to name from the slots, or an error */
        }
    }
    return ids_named(namer, hit);
}

/* ids_of_hit without the slots: known.get(hit), else ids_of(hit). */
static PyObject *
ids_named(const Namer *namer, PyObject *hit)
{
    PyObject *ids = NULL, *known = namer->known;
    if (known != NULL) {
        ids = PyDict_GetItemWithError(known, hit); /* borrowed */
        if (ids == NULL && PyErr_Occurred()) {
            return NULL;
        }
        Py_XINCREF(ids);
    }
    if (ids == NULL) {
        ids = PyObject_CallOneArg(namer->ids_of, hit);
        if (ids == NULL) {
            return NULL;
        }
    }
    if (!PyTuple_Check(ids) && !PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "ids_of must give a tuple or a list of node ids");
        Py_DECREF(ids);
        return NULL;
    }
    return ids;
}

/* The slots a depth is written at (``deepest_in``'s ``depths``): one uint32 per peer slot. */
typedef struct {
    uint32_t *at;
    Py_ssize_t slots;
} Depths;

static int
slot_past_depths(const Depths *depths, Py_ssize_t slot)
{
    PyErr_Format(PyExc_ValueError, "depths holds %zd slots, a bitmask sets slot %zd", depths->slots, slot);
    return -1;
}

/* depths[slot] = depth for every set bit of a 64-bit mask whose lowest bit is slot ``base``; nothing written where
 * its highest bit is past the array (raised, naming that slot, as the definition does). */
static int
write_word(const Depths *depths, unsigned long long word, Py_ssize_t base, Py_ssize_t depth)
{
    if (word && base + 63 - __builtin_clzll(word) >= depths->slots) {
        return slot_past_depths(depths, base + 63 - __builtin_clzll(word));
    }
    for (; word; word &= word - 1) {
        depths->at[base + __builtin_ctzll(word)] = (uint32_t)depth;
    }
    return 0;
}

/* depths[slot] = depth for every set bit of ``w`` (bit i: slot i); nothing written where its highest bit is past the
 * array (raised, naming that slot, as the definition does). */
static int
write_words(const Depths *depths, const Words *w, Py_ssize_t depth)
{
    for (Py_ssize_t i = (Py_ssize_t)w->count - 1; i >= 0; i--) {
        if (w->at[i]) { /* the highest slot first */
            Py_ssize_t highest = i * 64 + 63 - __builtin_clzll(w->at[i]);
            if (highest >= depths->slots) {
                return slot_past_depths(depths, highest);
            }
            break;
        }
    }
    int rc = 0;
    for (size_t i = 0; rc == 0 && i < w->count; i++) {
        rc = write_word(depths, w->at[i], (Py_ssize_t)(i * 64), depth);
    }
    return rc;
}

/* depths[slot] = depth for every set bit of ``hit``, a non-negative int (the levels' bitmasks are ints). */
static int
write_slots(const Depths *depths, PyObject *hit, Py_ssize_t depth)
{
    if (!PyLong_Check(hit)) {
        PyErr_Format(PyExc_TypeError, "depths needs int bitmasks, got %.100s", Py_TYPE(hit)->tp_name);
        return -1;
    }
    if (_PyLong_Sign(hit) < 0) {
        PyErr_SetString(PyExc_ValueError, "a bitmask must not be negative");
        return -1;
    }
    size_t bits = _PyLong_NumBits(hit);
    if (bits == (size_t)-1) {
        return -1;
    }
    if ((Py_ssize_t)bits > depths->slots) {
        return slot_past_depths(depths, (Py_ssize_t)bits - 1);
    }
#if PY_VERSION_HEX < 0x030C0000
    /* CPython's own digits (PyLong_SHIFT bits each, least significant first): a level's few set bits found by a
     * word scan, no conversion of the whole int */
    const digit *digits = ((PyLongObject *)hit)->ob_digit;
    for (Py_ssize_t i = 0; i < Py_SIZE(hit); i++) {
        if (digits[i] && write_word(depths, digits[i], i * PyLong_SHIFT, depth) < 0) {
            return -1;
        }
    }
    return 0;
#else
    Words words;
    if (mask_words(hit, &words) < 0) {
        return -1;
    }
    int rc = write_words(depths, &words, depth);
    words_release(&words);
    return rc;
#endif
}

/* ``(depth, ids)`` appended to ``found`` and *count grown by the ids: 0, or -1 with an exception set (ids NULL: the
 * error that made it so). Takes the reference to ``ids``. */
static int
append_level(PyObject *found, Py_ssize_t depth, PyObject *ids, Py_ssize_t *count)
{
    PyObject *at = ids == NULL ? NULL : PyLong_FromSsize_t(depth);
    PyObject *level = at == NULL ? NULL : PyTuple_Pack(2, at, ids);
    int rc = level == NULL ? -1 : PyList_Append(found, level);
    if (rc == 0) {
        *count += PySequence_Fast_GET_SIZE(ids);
    }
    Py_XDECREF(level);
    Py_XDECREF(at);
    Py_XDECREF(ids);
    return rc;
}

/* The summary key of hashes[depth - 1] (its low 32 bits, as cache/summary_log.summary_key) in *key: 1, or 0 where
 * ``hashes`` is shorter than ``depth`` (it may shrink under an ids_of call), or -1 with an exception set. */
static int
key_at(PyObject *hashes, Py_ssize_t depth, uint32_t *key)
{
    if (depth > PySequence_Fast_GET_SIZE(hashes)) {
        return 0;
    }
    unsigned long long h = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(hashes, depth - 1));
    if (h == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *key = (uint32_t)(h & 0xFFFFFFFFULL);
    return 1;
}

/* The bitmask of the peers publishing the summary key of hashes[depth - 1] (its low 32 bits, as
 * cache/summary_log.summary_key): a new reference in *bits, or NULL there for none (also when ``hashes`` has shrunk
 * under an ids_of call). 0, or -1 with an exception set. */
static int
published_at(PyObject *hashes, Py_ssize_t depth, PyObject *inverted, PyObject **bits)
{
    uint32_t summary_key;
    *bits = NULL;
    int rc = key_at(hashes, depth, &summary_key);
    if (rc <= 0) {
        return rc;
    }
    PyObject *key = PyLong_FromUnsignedLong(summary_key);
    if (key == NULL) {
        return -1;
    }
    *bits = PyDict_GetItemWithError(inverted, key); /* borrowed */
    Py_DECREF(key);
    if (*bits == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(*bits);
    return 0;
}

/* The row of the summary key of hashes[depth - 1] in a MaskTable, in *row (NULL: none, also when ``hashes`` has
 * shrunk under an ids_of call): valid until the table next changes. 0, or -1 with an exception set. */
static int
table_row_at(PyObject *hashes, Py_ssize_t depth, MaskTable *table, const uint64_t **row)
{
    uint32_t key;
    *row = NULL;
    int rc = key_at(hashes, depth, &key);
    if (rc > 0) {
        *row = mt_find(table, key);
    }
    return rc < 0 ? -1 : 0;
}

/* published_at's bitmask taken modulo 2**64 (0: none): what a group of peers in the first 64 slots reads of it.
 * 1 when it is not an exact int (the general path then reads the group, as the definition would). */
static int
published_at_64(PyObject *hashes, Py_ssize_t depth, PyObject *inverted, unsigned long long *bits)
{
    PyObject *found;
    *bits = 0;
    if (Py_IS_TYPE(inverted, &MaskTable_Type)) {
        const uint64_t *row = NULL;
        if (table_row_at(hashes, depth, (MaskTable *)inverted, &row) < 0) {
            return -1;
        }
        *bits = row != NULL ? row[1] : 0;
        return 0;
    }
    if (published_at(hashes, depth, inverted, &found) < 0) {
        return -1;
    }
    if (found != NULL) {
        int exact = PyLong_CheckExact(found);
        *bits = exact ? PyLong_AsUnsignedLongLongMask(found) : 0;
        Py_DECREF(found);
        if (!exact) {
            return 1;
        }
        if (*bits == (unsigned long long)-1 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

/* group_levels for a group whose mask fits in 64 bits (a mesh of up to 64 peers): the same levels, its masks as
 * machine words instead of a Python int per operation (x & remaining only reads remaining's 64 bits). 1 when a
 * bitmask is not an exact int: the caller drops what was appended and reads the group the general way. */
static int
group_levels_64(PyObject *hashes, Py_ssize_t stride, unsigned long long remaining, PyObject *inverted,
                const Namer *namer, PyObject *found, Py_ssize_t *count, const Depths *depths)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    Py_ssize_t depth = n - n % stride;
    unsigned long long bits = 0;
    int rc = depth >= stride ? published_at_64(hashes, depth, inverted, &bits) : 0;
    if (rc != 0) {
        return rc;
    }
    for (; depth >= stride && remaining; depth -= stride) {
        unsigned long long below = ~0ULL; /* the first stride has no depth before it */
        if (depth > stride && (rc = published_at_64(hashes, depth - stride, inverted, &below)) != 0) {
            return rc;
        }
        unsigned long long hit = bits & below & remaining;
        if (hit) {
            remaining ^= hit;
            if (depths != NULL && write_word(depths, hit, 0, depth) < 0) {
                return -1;
            }
            PyObject *ids;
            if (namer->slot_ids != NULL && __builtin_popcountll(hit) <= DECODE_AT_MOST) {
                Words words; /* the hit's one word: no int made of it */
                words.small[0] = hit;
                words.at = words.small;
                words.count = 1;
                ids = ids_at_words(&words, namer->slot_ids);
            }
            else {
                PyObject *mask = PyLong_FromUnsignedLongLong(hit);
                ids = mask == NULL ? NULL : ids_of_hit(namer, mask);
                Py_XDECREF(mask);
            }
            if (append_level(found, depth, ids, count) < 0) {
                return -1;
            }
        }
        bits = below;
    }
    return 0;
}

/* Whether a & b & c sets any bit (b NULL: every bit): 1 or 0, read from the ints' own digits with nothing made, or
 * -1 where it cannot tell so (an int that is not exact or is negative; CPython 3.12 on): the caller computes it. Most
 * depths a request probes hold none of the group's remaining peers; at 1,000 peers each such probe made two
 * 1,000-bit ints to learn that. */
static int
and3_any(PyObject *a, PyObject *b, PyObject *c)
{
#if PY_VERSION_HEX < 0x030C0000
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(c) || (b != NULL && !PyLong_CheckExact(b)) || Py_SIZE(a) < 0
        || Py_SIZE(c) < 0 || (b != NULL && Py_SIZE(b) < 0)) {
        return -1;
    }
    Py_ssize_t n = Py_SIZE(a) < Py_SIZE(c) ? Py_SIZE(a) : Py_SIZE(c);
    if (b != NULL && Py_SIZE(b) < n) {
        n = Py_SIZE(b);
    }
    const digit *da = ((PyLongObject *)a)->ob_digit, *dc = ((PyLongObject *)c)->ob_digit;
    const digit *db = b != NULL ? ((PyLongObject *)b)->ob_digit : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (da[i] & dc[i] & (db != NULL ? db[i] : PyLong_MASK)) {
            return 1;
        }
    }
    return 0;
#else
    (void)a;
    (void)b;
    (void)c;
    return -1;
#endif
}

/* The mask words of the row of hashes[depth - 1]'s key, the first ``count`` of them (zeros past the row's width), in
 * ``into``: 1 when the key is published, 0 when it is not (``into`` then all zero), -1 with an exception set. Copied:
 * an ids_of call may change the table under the caller. */
static int
table_words_at(PyObject *hashes, Py_ssize_t depth, MaskTable *table, unsigned long long *into, Py_ssize_t count)
{
    const uint64_t *row;
    if (table_row_at(hashes, depth, table, &row) < 0) {
        return -1;
    }
    if (row != NULL) {
        mt_copy_words(table, row, into, count);
    }
    else {
        memset(into, 0, (size_t)count * sizeof(unsigned long long));
    }
    return row != NULL;
}

/* group_levels of a group of any width read from a MaskTable: the same levels, every bitmask operation on the
 * group's words (its mask's width) with no int made, but for a level of more than DECODE_AT_MOST peers (named by
 * known / ids_of, which take ints). */
static int
group_levels_table(PyObject *hashes, Py_ssize_t stride, PyObject *group_mask, MaskTable *table, const Namer *namer,
                   PyObject *found, Py_ssize_t *count, const Depths *depths)
{
    if (!PyLong_Check(group_mask)) {
        PyErr_Format(PyExc_TypeError, "a group's mask must be an int, got %.100s", Py_TYPE(group_mask)->tp_name);
        return -1;
    }
    Words remaining;
    if (mask_words(group_mask, &remaining) < 0) {
        return -1;
    }
    Py_ssize_t w = (Py_ssize_t)remaining.count;
    unsigned long long small[48], *buffer = small;
    if (w > 16 && (buffer = PyMem_Malloc(3 * (size_t)w * sizeof(unsigned long long))) == NULL) {
        words_release(&remaining);
        PyErr_NoMemory();
        return -1;
    }
    unsigned long long *bits = buffer, *below = buffer + w, *hit = buffer + 2 * w, *rem = remaining.at;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    Py_ssize_t depth = n - n % stride;
    int rc = 0, has_bits = depth >= stride ? table_words_at(hashes, depth, table, bits, w) : 0;
    if (has_bits < 0) {
        rc = -1;
    }
    for (; rc == 0 && depth >= stride; depth -= stride) {
        unsigned long long left = 0;
        for (Py_ssize_t i = 0; i < w; i++) {
            left |= rem[i];
        }
        if (!left) {
            break;
        }
        int has_below = 1;
        if (depth > stride) {
            has_below = table_words_at(hashes, depth - stride, table, below, w);
            if (has_below < 0) {
                rc = -1;
                break;
            }
        }
        else {
            memset(below, 0xFF, (size_t)w * sizeof(unsigned long long)); /* the first stride has no depth before it */
        }
        unsigned long long any = 0;
        if (has_bits && has_below) {
            for (Py_ssize_t i = 0; i < w; i++) {
                hit[i] = bits[i] & below[i] & rem[i];
                any |= hit[i];
            }
        }
        if (any) {
            Words level = {.at = hit, .count = (size_t)w};
            for (Py_ssize_t i = 0; i < w; i++) {
                rem[i] ^= hit[i];
            }
            if (depths != NULL) {
                rc = write_words(depths, &level, depth);
            }
            PyObject *ids = NULL;
            if (rc == 0 && namer->slot_ids != NULL && words_popcount(&level) <= DECODE_AT_MOST) {
                ids = ids_at_words(&level, namer->slot_ids);
            }
            else if (rc == 0) {
                PyObject *mask = mt_words_int((const uint64_t *)hit, w);
                ids = mask == NULL ? NULL : ids_named(namer, mask);
                Py_XDECREF(mask);
            }
            if (rc == 0) {
                rc = append_level(found, depth, ids, count);
            }
        }
        unsigned long long *swap = bits;
        bits = below;
        below = swap;
        has_bits = has_below;
    }
    if (buffer != small) {
        PyMem_Free(buffer);
    }
    words_release(&remaining);
    return rc;
}

/* The levels of one (stride, mask) group, deepest first, appended to ``found`` as (depth, ids); *count grows by the
 * ids found. A peer takes a depth where it publishes that depth's key and, past the first stride, the key a stride
 * before (the definition's guard against a 32-bit collision). 0, or -1 with an exception set. */
static int
group_levels(PyObject *hashes, PyObject *group, PyObject *inverted, const Namer *namer, PyObject *found,
             Py_ssize_t *count, const Depths *depths)
{
    if (!PyTuple_Check(group) || PyTuple_GET_SIZE(group) != 2) {
        PyErr_SetString(PyExc_TypeError, "groups must hold (stride, mask) tuples");
        return -1;
    }
    Py_ssize_t stride = PyLong_AsSsize_t(PyTuple_GET_ITEM(group, 0));
    if (stride == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "a stride must be >= 1, got %zd", stride);
        return -1;
    }
    if (PyLong_CheckExact(PyTuple_GET_ITEM(group, 1))) {
        unsigned long long mask = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(group, 1));
        if (!(mask == (unsigned long long)-1 && PyErr_Occurred())) {
            Py_ssize_t first = PyList_GET_SIZE(found), counted = *count;
            uint32_t kept[64]; /* the slots this group may write, as they were: put back if it is read again */
            for (int b = 0; depths != NULL && b < 64 && b < depths->slots; b++) {
                kept[b] = depths->at[b];
            }
            int rc = group_levels_64(hashes, stride, mask, inverted, namer, found, count, depths);
            if (rc <= 0) {
                return rc;
            }
            for (int b = 0; depths != NULL && b < 64 && b < depths->slots; b++) {
                depths->at[b] = kept[b];
            }
            if (PyList_SetSlice(found, first, PyList_GET_SIZE(found), NULL) < 0) { /* a bitmask of another type */
                return -1;
            }
            *count = counted;
        }
        else {
            PyErr_Clear(); /* negative, or past 64 bits: Python ints */
        }
    }
    if (Py_IS_TYPE(inverted, &MaskTable_Type)) {
        return group_levels_table(hashes, stride, PyTuple_GET_ITEM(group, 1), (MaskTable *)inverted, namer, found,
                                  count, depths);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject *remaining = Py_NewRef(PyTuple_GET_ITEM(group, 1));
    PyObject *bits = NULL, *below = NULL;
    Py_ssize_t depth = n - n % stride;
    int rc = depth >= stride ? published_at(hashes, depth, inverted, &bits) : 0;
    for (; rc == 0 && depth >= stride; depth -= stride) {
        int any = PyObject_IsTrue(remaining);
        if (any <= 0) {
            rc = any;
            break;
        }
        if (depth > stride && published_at(hashes, depth - stride, inverted, &below) < 0) {
            rc = -1;
            break;
        }
        if (bits != NULL && (depth == stride || below != NULL)
            && and3_any(bits, depth > stride ? below : NULL, remaining) != 0) {
            PyObject *hit = PyNumber_And(bits, remaining);
            if (hit != NULL && depth > stride) {
                Py_SETREF(hit, PyNumber_And(hit, below));
            }
            int taken = hit == NULL ? -1 : PyObject_IsTrue(hit);
            if (taken > 0 && depths != NULL && write_slots(depths, hit, depth) < 0) {
                taken = -1;
            }
            if (taken > 0) {
                PyObject *left = PyNumber_Xor(remaining, hit);
                taken = append_level(found, depth, left == NULL ? NULL : ids_of_hit(namer, hit), count);
                if (left != NULL) {
                    Py_SETREF(remaining, left);
                }
            }
            Py_XDECREF(hit);
            rc = taken < 0 ? -1 : 0;
        }
        Py_XSETREF(bits, below);
        below = NULL;
    }
    Py_XDECREF(bits);
    Py_XDECREF(below);
    Py_DECREF(remaining);
    return rc;
}

static PyObject *
deepest_in(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 4 || nargs > 8) {
        PyErr_SetString(PyExc_TypeError, "deepest_in(hashes, groups, inverted, ids_of, levels=None, known=None, "
                                         "depths=None, slot_ids=None)");
        return NULL;
    }
    PyObject *hashes = args[0], *groups = args[1], *inverted = args[2], *ids_of = args[3];
    PyObject *levels = nargs > 4 && args[4] != Py_None ? args[4] : NULL;
    PyObject *known = nargs > 5 && args[5] != Py_None ? args[5] : NULL;
    PyObject *slot_ids = nargs > 7 && args[7] != Py_None ? args[7] : NULL;
    if (!PyList_Check(hashes) && !PyTuple_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes must be a list or a tuple");
        return NULL;
    }
    /* exact types, as leading_in's: a subclass's own lookups would be bypassed */
    if (!PyList_Check(groups) || !(PyDict_CheckExact(inverted) || Py_IS_TYPE(inverted, &MaskTable_Type))
        || (levels != NULL && !PyList_CheckExact(levels)) || (known != NULL && !PyDict_CheckExact(known))
        || (slot_ids != NULL && !PyList_Check(slot_ids))) {
        PyErr_SetString(PyExc_TypeError,
                        "groups must be a list, inverted a dict or a MaskTable, levels a list, known a dict, slot_ids "
                        "a list");
        return NULL;
    }
    Py_buffer view = {0};
    Depths depths = {0};
    if (nargs > 6 && args[6] != Py_None) {
        if (PyObject_GetBuffer(args[6], &view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            return NULL;
        }
        if (view.itemsize != 4 || view.format == NULL || strcmp(view.format, "I") != 0) {
            PyErr_SetString(PyExc_TypeError, "depths must be a writable buffer of 4-byte unsigned items: array('I')");
            PyBuffer_Release(&view);
            return NULL;
        }
        depths.at = view.buf;
        depths.slots = view.len / 4;
    }
    PyObject *found = levels != NULL ? Py_NewRef(levels) : PyList_New(0);
    if (found == NULL) {
        if (view.obj != NULL) {
            PyBuffer_Release(&view);
        }
        return NULL;
    }
    /* First the levels (into the caller's list, or one of our own), counting their ids; then the answer, in a dict
     * sized for them: the same items in the same order as the definition's (none with ``depths``). */
    Py_ssize_t first = PyList_GET_SIZE(found), count = 0;
    Namer namer = {known, ids_of, slot_ids};
    PyObject *result = NULL;
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        PyObject *group = Py_NewRef(PyList_GET_ITEM(groups, g)); /* held: ids_of (Python) may change groups */
        int rc = group_levels(hashes, group, inverted, &namer, found, &count, view.obj != NULL ? &depths : NULL);
        Py_DECREF(group);
        if (rc < 0) {
            goto done;
        }
    }
    if (view.obj != NULL) {
        result = PyDict_New(); /* every estimate is in depths */
        goto done;
    }
    result = new_dict_for(count);
    for (Py_ssize_t i = first; result != NULL && i < PyList_GET_SIZE(found); i++) {
        PyObject *level = PyList_GET_ITEM(found, i);
        if (!PyTuple_Check(level) || PyTuple_GET_SIZE(level) != 2 || !(PyTuple_Check(PyTuple_GET_ITEM(level, 1))
                                                                      || PyList_Check(PyTuple_GET_ITEM(level, 1)))) {
            PyErr_SetString(PyExc_RuntimeError, "levels changed while they were read");  /* by ids_of: never ours */
            Py_CLEAR(result);
            break;
        }
        PyObject *at = PyTuple_GET_ITEM(level, 0), *ids = PyTuple_GET_ITEM(level, 1);
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(ids); j++) {
            if (PyDict_SetItem(result, PySequence_Fast_GET_ITEM(ids, j), at) < 0) {
                Py_CLEAR(result);
                break;
            }
        }
    }
done:
    Py_DECREF(found);
    if (view.obj != NULL) {
        PyBuffer_Release(&view);
    }
    return result;
}

/* ids_of_mask (module docstring): the node ids of a bitmask's set bits, lowest first. */
static PyObject *
ids_of_mask(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 || !PyLong_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "ids_of_mask(mask: int, slot_ids: list)");
        return NULL;
    }
    return ids_of_int(args[0], args[1], PY_SSIZE_T_MAX);
}

/* block_hash.mix64: splitmix64's finaliser of any int, taken modulo 2**64 as the Python's ``& _MASK64`` takes it. */
static PyObject *
mix64(PyObject *module, PyObject *h)
{
    (void)module;
    if (!PyLong_Check(h)) {
        PyErr_Format(PyExc_TypeError, "mix64 takes an int, got %.100s", Py_TYPE(h)->tp_name);
        return NULL;
    }
    unsigned long long z = PyLong_AsUnsignedLongLongMask(h);
    if (z == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return PyLong_FromUnsignedLongLong(z ^ (z >> 31));
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(tokens, block_size, seed) -> chained xxh3_64 hashes of the full blocks of a list of token ids"},
    {"leading_in", (PyCFunction)(void (*)(void))leading_in, METH_FASTCALL,
     "leading_in(hashes, present) -> how many leading items of a list or tuple are in a dict or set"},
    {"mix64", (PyCFunction)mix64, METH_O, "mix64(h) -> splitmix64's finaliser of h modulo 2**64"},
    {"ids_of_mask", (PyCFunction)(void (*)(void))ids_of_mask, METH_FASTCALL,
     "ids_of_mask(mask, slot_ids) -> the node ids at the set bits of mask, lowest slot first"},
    {"deepest_in", (PyCFunction)(void (*)(void))deepest_in, METH_FASTCALL,
     "deepest_in(hashes, groups, inverted, ids_of, levels=None, known=None, depths=None, slot_ids=None) -> {node id: "
     "deepest depth "
     "published}; with depths, each level's depth written at its slots there instead"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_chain", "p2pnode's block-hash chain and prefix match in C (see block_hash.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    if (PyType_Ready(&MaskTable_Type) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddObjectRef(module, "MaskTable", (PyObject *)&MaskTable_Type) < 0) {
        Py_CLEAR(module);
    }
    return module;
}
