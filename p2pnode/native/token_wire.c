/* p2pnode._token_wire: a prompt's token ids to and from protobuf's wire form, without upb's int per token.
 *
 * A 4,096-token prompt crosses protobuf up to three times per request (the client's GenerateRequest, the
 * ForwardRequest its ingress sends, the same message parsed at the serving peer). upb's Python containers convert a
 * repeated uint32 field one Python call per item: ~80 us to fill one from a list, ~110 us to read one into a list,
 * ~45 us more for the vocabulary check's max() -- more than the rest of a forwarding hop. Here each way is one C pass.
 *
 * Contract (checked against protobuf's own encoder and parser by tests/unit/test_token_wire.py):
 *   pack(field_number: int, tokens: list | tuple) -> bytes
 *     the wire form of a ``repeated uint32`` field holding ``tokens``, packed (tag, length, varints); b"" when
 *     empty (proto3 writes nothing for an empty repeated field). Appended to a message serialized without that
 *     field, it gives the message with it: protobuf parses a field wherever it comes. Token errors: read_token.h.
 *   unpack(data: bytes-like, field_number: int, packed: bool = False) -> (list[int], int[, bytes])
 *     the values of the top-level field ``field_number`` of the message ``data``, as protobuf parses a repeated
 *     uint32 (packed runs and single varints alike, in order, each cut to 32 bits), and their maximum (-1: none);
 *     with ``packed``, also the values as 4 little-endian bytes each (the block hash's input: the chain then reads
 *     no Python int). Malformed wire data raises ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "read_token.h"

enum { WIRE_VARINT = 0, WIRE_FIXED64 = 1, WIRE_LEN = 2, WIRE_FIXED32 = 5 };

static inline size_t
varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline unsigned char *
put_varint(unsigned char *dst, uint64_t v)
{
    while (v >= 0x80) {
        *dst++ = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    *dst++ = (unsigned char)v;
    return dst;
}

/* One varint at *pos (before end); 0 and *pos past it, or -1 when it runs past end or over 10 bytes. */
static inline int
get_varint(const unsigned char **pos, const unsigned char *end, uint64_t *out)
{
    const unsigned char *p = *pos;
    uint64_t v = 0;
    for (int shift = 0; shift < 70 && p < end; shift += 7) {
        unsigned char b = *p++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *pos = p;
            *out = v;
            return 0;
        }
    }
    return -1;
}

static int
field_number_of(PyObject *arg, uint32_t *out)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (n < 1 || n > 536870911) {
        PyErr_SetString(PyExc_ValueError, "field_number must be in [1, 2**29)");
        return -1;
    }
    *out = (uint32_t)n;
    return 0;
}

static PyObject *
pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pack(field_number: int, tokens: list | tuple)");
        return NULL;
    }
    uint32_t field;
    if (field_number_of(args[0], &field) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "tokens must be a list or a tuple");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_DECREF(seq);
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    uint32_t *values = PyMem_Malloc((size_t)n * sizeof(uint32_t));
    if (values == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    size_t payload = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (read_token(items[i], &values[i]) < 0) {
            PyMem_Free(values);
            Py_DECREF(seq);
            return NULL;
        }
        payload += varint_size(values[i]);
    }
    Py_DECREF(seq);
    uint64_t tag = ((uint64_t)field << 3) | WIRE_LEN;
    size_t size = varint_size(tag) + varint_size(payload) + payload;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out != NULL) {
        unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
        dst = put_varint(dst, tag);
        dst = put_varint(dst, payload);
        for (Py_ssize_t i = 0; i < n; i++) {
            dst = put_varint(dst, values[i]);
        }
    }
    PyMem_Free(values);
    return out;
}

/* The Python ints of token ids below TOKEN_INTS (every vocabulary's today: ~150k at most), made once per process
 * and shared by every prompt read since (ints are immutable): a prompt's list then costs a reference per token, not
 * an allocation. At most TOKEN_INTS ints (~9 MB with the pointers, filled only as ids are seen). */
#define TOKEN_INTS (1u << 18)
static PyObject *token_ints[TOKEN_INTS];

/* A token as a (new reference to a) Python int. */
static inline PyObject *
token_object(uint64_t v)
{
    uint32_t value = (uint32_t)v; /* a uint32 field keeps the low 32 bits of a longer varint, as protobuf does */
    if (value >= TOKEN_INTS) {
        return PyLong_FromUnsignedLong(value);
    }
    PyObject *item = token_ints[value];
    if (item == NULL) {
        item = PyLong_FromLong((long)value);
        if (item == NULL) {
            return NULL;
        }
        token_ints[value] = item; /* the table's reference, kept for the process's life */
    }
    return Py_NewRef(item);
}

/* One pass over the message's fields: with out == NULL, counts the values of the field in *count; else stores them
 * in out (a list of *count items), keeping the maximum, and (packed != NULL) their 4 little-endian bytes each in
 * packed. Returns NULL, or what is malformed. */
static const char *
scan(const unsigned char *p, const unsigned char *end, uint32_t field, PyObject *out, unsigned char *packed,
     Py_ssize_t *count, long long *max)
{
    Py_ssize_t n = 0;
    while (p < end) {
        uint64_t tag, v;
        if (get_varint(&p, end, &tag) < 0) {
            return "a tag runs past the end";
        }
        unsigned wire = (unsigned)(tag & 7);
        int ours = (tag >> 3) == field;
        if (wire == WIRE_VARINT) {
            if (get_varint(&p, end, &v) < 0) {
                return "a varint runs past the end";
            }
            if (ours) {
                if (out != NULL) {
                    PyList_SET_ITEM(out, n, token_object(v));
                    if (packed != NULL) {
                        store_le32(packed + 4 * n, (uint32_t)v);
                    }
                    if ((long long)(uint32_t)v > *max) {
                        *max = (uint32_t)v;
                    }
                }
                n++;
            }
        }
        else if (wire == WIRE_LEN) {
            uint64_t length;
            if (get_varint(&p, end, &length) < 0 || length > (uint64_t)(end - p)) {
                return "a length-delimited field runs past the end";
            }
            const unsigned char *stop = p + length;
            if (!ours) {
                p = stop;
                continue;
            }
            if (out == NULL) { /* a packed run holds one value per byte without the continuation bit */
                if (length > 0 && (stop[-1] & 0x80)) {
                    return "a packed varint runs past its field";
                }
                for (; p < stop; p++) {
                    n += !(*p & 0x80);
                }
                continue;
            }
            while (p < stop) {
                if (get_varint(&p, stop, &v) < 0) {
                    return "a packed varint runs past its field";
                }
                PyList_SET_ITEM(out, n, token_object(v));
                if (packed != NULL) {
                    store_le32(packed + 4 * n, (uint32_t)v);
                }
                if ((long long)(uint32_t)v > *max) {
                    *max = (uint32_t)v;
                }
                n++;
            }
        }
        else if (wire == WIRE_FIXED64 || wire == WIRE_FIXED32) {
            size_t skip = wire == WIRE_FIXED64 ? 8 : 4;
            if (ours) {
                return "the field is not a uint32";
            }
            if (skip > (size_t)(end - p)) {
                return "a fixed-size field runs past the end";
            }
            p += skip;
        }
        else {
            return "an unknown or group wire type";
        }
    }
    *count = n;
    return NULL;
}

static PyObject *
unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unpack(data: bytes-like, field_number: int, packed: bool = False)");
        return NULL;
    }
    uint32_t field;
    if (field_number_of(args[1], &field) < 0) {
        return NULL;
    }
    int want_packed = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (want_packed < 0) {
        return NULL;
    }
    /* Immutable bytes read twice (count, then fill): a bytearray changed between the passes (a collection can run
     * Python) wrote past the list it had counted for, so any other buffer is copied to bytes first. */
    PyObject *data = PyBytes_CheckExact(args[0]) ? Py_NewRef(args[0]) : PyBytes_FromObject(args[0]);
    if (data == NULL) {
        return NULL;
    }
    const unsigned char *begin = (const unsigned char *)PyBytes_AS_STRING(data), *end = begin + PyBytes_GET_SIZE(data);
    PyObject *result = NULL;
    Py_ssize_t count = 0;
    long long max = -1;
    const char *error = scan(begin, end, field, NULL, NULL, &count, &max);
    if (error == NULL) {
        /* Counted, then filled: the list is never seen half-filled (a Python int cannot fail to be made but for
         * memory, and then the list is dropped whole). */
        PyObject *list = PyList_New(count);
        PyObject *packed = want_packed ? PyBytes_FromStringAndSize(NULL, count * 4) : NULL;
        if (list != NULL && (packed != NULL || !want_packed)) {
            Py_ssize_t filled = 0;
            unsigned char *bytes = packed == NULL ? NULL : (unsigned char *)PyBytes_AS_STRING(packed);
            error = scan(begin, end, field, list, bytes, &filled, &max);
            for (Py_ssize_t i = 0; error == NULL && i < count; i++) {
                if (PyList_GET_ITEM(list, i) == NULL) {
                    error = "";
                }
            }
            if (error == NULL && filled == count) {
                result = packed == NULL ? Py_BuildValue("(NL)", list, max) : Py_BuildValue("(NLN)", list, max, packed);
                list = packed = NULL;  /* the tuple's now (or, on failure, dropped by Py_BuildValue) */
            }
        }
        Py_XDECREF(list);
        Py_XDECREF(packed);
    }
    if (error != NULL && *error) {
        PyErr_Format(PyExc_ValueError, "malformed protobuf message: %s", error);
    }
    else if (result == NULL && !PyErr_Occurred()) {
        PyErr_NoMemory();
    }
    Py_DECREF(data);
    return result;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(field_number, tokens) -> the wire form of a packed repeated uint32 field holding the tokens"},
    {"unpack", (PyCFunction)(void (*)(void))unpack, METH_FASTCALL,
     "unpack(data, field_number, packed=False) -> (the values of a repeated uint32 field of a message, their maximum "
     "or -1[, the values as little-endian uint32 bytes])"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_token_wire", "Token ids to and from protobuf's wire form in C (see token_wire.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__token_wire(void)
{
    return PyModule_Create(&module_def);
}
