/* p2pnode._frozen: a frozen slots dataclass's __init__ and ``dataclasses.replace`` in C.
 *
 * The routing decision and the simulator build a dozen frozen dataclasses per request (a peer's snapshot, the
 * policy's request, its decision, the route). A frozen dataclass's generated __init__ sets each field through
 * ``object.__setattr__`` (~90 ns a field here, ~2 us for a 16-field snapshot), and ``dataclasses.replace`` reads
 * every field back by name first. Here both write the slots by their offsets.
 *
 * Contract (held to the Python by tests/unit/test_frozen.py; ``p2pnode/frozen.py`` decides which classes qualify):
 *   Init(cls, names, by_position, kinds, defaults, post_init) -> a method descriptor for ``cls.__init__``
 *   ``names``: every field, in the dataclass's order, each stored in a writable object slot of ``cls`` (its member
 *   descriptor, found on ``cls``; at most 64); ``by_position``: the index in ``names`` of each parameter that may be
 *   given by position, in the signature's order; ``kinds``: per field 0 required, 1 a default (``defaults``' entry),
 *   2 a default factory (``defaults``' entry, called); ``post_init``: whether to call ``self.__post_init__()`` after
 *   setting every field. Called as ``cls(...)``, it takes the same arguments as the dataclass's generated __init__,
 *   raises TypeError where it does (a missing, unknown, repeated argument, or too many by position: before any
 *   default factory runs), sets the fields in their order and calls ``__post_init__`` (its result ignored). The
 *   class's own calls go to ``class_vectorcall`` (``object.__new__`` then this, without ``type.__call__``'s tuple
 *   and dict) while it is a plain heap type with this very Init and no __new__ of its own.
 *
 *   replace(obj, **changes) -> a new instance of type(obj): every field of ``obj`` with ``changes`` over them, built
 *   as the generated __init__ would (``__post_init__`` included); NotImplemented unless type(obj) is such a class
 *   (the caller then runs ``dataclasses.replace``).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "structmember.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;   /* strong */
    PyObject *names;     /* tuple of interned str, the fields' order */
    PyObject *defaults;  /* tuple, the fields' order */
    Py_ssize_t n;        /* fields */
    Py_ssize_t positional;
    Py_ssize_t *by_position; /* the field each positional parameter sets */
    int post_init;
    Py_ssize_t *offsets; /* the fields' order */
    unsigned char *kinds;
} Init;

static PyTypeObject InitType;
static PyObject *s_post_init, *s_init;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static void
set_slot(PyObject *obj, Py_ssize_t off, PyObject *value)
{
    PyObject *old = SLOT(obj, off);
    Py_INCREF(value);
    SLOT(obj, off) = value;
    Py_XDECREF(old);
}

/* The index of ``name`` among the fields; -1 for none, -2 with an exception set. Interned names compare by identity
 * first, then as CPython matches a keyword to a parameter (``==``). */
static Py_ssize_t
field_index(Init *init, PyObject *name)
{
    PyObject **names = &PyTuple_GET_ITEM(init->names, 0);
    for (Py_ssize_t i = 0; i < init->n; i++) {
        if (names[i] == name) {
            return i;
        }
    }
    for (Py_ssize_t i = 0; i < init->n; i++) {
        int eq = PyObject_RichCompareBool(name, names[i], Py_EQ);
        if (eq != 0) {
            return eq > 0 ? i : -2;
        }
    }
    return -1;
}

/* Set every field of ``self`` from ``values`` (NULL: not given; the default then), in the fields' order as the
 * generated __init__ does, then __post_init__ (its result ignored, as there). A required field not given raises
 * TypeError before anything runs (the generated __init__'s arguments are bound before its body). */
static int
fill(Init *init, PyObject *self, PyObject **values)
{
    for (Py_ssize_t i = 0; i < init->n; i++) {
        if (values[i] == NULL && init->kinds[i] == 0) {
            PyErr_Format(PyExc_TypeError, "%s.__init__() missing required argument: '%U'", init->cls->tp_name,
                         PyTuple_GET_ITEM(init->names, i));
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < init->n; i++) {
        PyObject *value = values[i];
        if (value != NULL) {
            set_slot(self, init->offsets[i], value);
            continue;
        }
        switch (init->kinds[i]) {
        case 1:
            set_slot(self, init->offsets[i], PyTuple_GET_ITEM(init->defaults, i));
            break;
        case 2: {
            PyObject *made = PyObject_CallNoArgs(PyTuple_GET_ITEM(init->defaults, i));
            if (made == NULL) {
                return -1;
            }
            set_slot(self, init->offsets[i], made);
            Py_DECREF(made);
            break;
        }
        default:
            break; /* checked above */
        }
    }
    if (init->post_init) {
        PyObject *res = PyObject_CallMethodNoArgs(self, s_post_init);
        if (res == NULL) {
            return -1;
        }
        Py_DECREF(res);
    }
    return 0;
}

#define MAX_FIELDS 64

/* Each keyword of a vectorcall (``kwnames``, their values in ``kwvalues``) into ``values`` by its field; TypeError
 * for an unknown field or one ``values`` holds already. */
static int
take_keywords(Init *init, PyObject *const *kwvalues, PyObject *kwnames, PyObject **values)
{
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = field_index(init, name);
        if (i < 0) {
            if (i == -1) {
                PyErr_Format(PyExc_TypeError, "%s.__init__() got an unexpected keyword argument '%S'",
                             init->cls->tp_name, name);
            }
            return -1;
        }
        if (values[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s.__init__() got multiple values for argument '%U'", init->cls->tp_name,
                         PyTuple_GET_ITEM(init->names, i));
            return -1;
        }
        values[i] = kwvalues[k];
    }
    return 0;
}

/* ``self.__init__(*args, **kw)`` with the call's arguments as a vector (``kwnames``' values after ``args``). */
static int
init_args(Init *init, PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs > init->positional) {
        PyErr_Format(PyExc_TypeError, "%s.__init__() takes %zd positional arguments but %zd were given",
                     init->cls->tp_name, init->positional + 1, nargs + 1);
        return -1;
    }
    PyObject *values[MAX_FIELDS] = {NULL};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        values[init->by_position[i]] = args[i];
    }
    if (take_keywords(init, args + nargs, kwnames, values) < 0) {
        return -1;
    }
    return fill(init, self, values);
}

/* The class's own Init when ``cls(...)`` is exactly ``object.__new__`` then that Init: a plain heap type of ``type``,
 * not abstract, no __new__ of its own; NULL (borrowed otherwise) for anything else, which ``type.__call__`` and
 * ``dataclasses.replace`` then handle. */
static Init *
own_init(PyTypeObject *cls)
{
    PyObject *found = _PyType_Lookup(cls, s_init);
    if (found == NULL || Py_TYPE(found) != &InitType || ((Init *)found)->cls != cls || !Py_IS_TYPE(cls, &PyType_Type)
        || cls->tp_new != PyBaseObject_Type.tp_new || (cls->tp_flags & Py_TPFLAGS_IS_ABSTRACT)) {
        return NULL;
    }
    return (Init *)found;
}

static PyObject *
init_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Init *init = (Init *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || !PyObject_TypeCheck(args[0], init->cls)) {
        PyErr_Format(PyExc_TypeError, "%s.__init__() needs an instance of it first", init->cls->tp_name);
        return NULL;
    }
    if (init_args(init, args[0], args + 1, nargs - 1, kwnames) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ``cls(...)`` for a class whose __init__ is its own Init: what ``type.__call__`` does (``object.__new__``, then
 * the __init__), without packing the arguments into a tuple and a dict. Anything else -- a subclass that inherits
 * it, a __new__ or an __init__ set since -- goes through ``type.__call__``. */
static PyObject *
class_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyTypeObject *cls = (PyTypeObject *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Init *found = own_init(cls);
    if (found != NULL) {
        /* held before anything can run Python code (an allocation can collect, and a callback drop the class's
         * __init__), through __post_init__ */
        Init *init = (Init *)Py_NewRef(found);
        PyObject *self = cls->tp_alloc(cls, 0);
        if (self == NULL) {
            Py_DECREF(init);
            return NULL;
        }
        int failed = init_args(init, self, args, nargs, kwnames) < 0;
        Py_DECREF(init);
        if (failed) {
            Py_DECREF(self);
            return NULL;
        }
        return self;
    }
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    }
    PyObject *kwargs = NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nkw > 0) {
        kwargs = PyDict_New();
        for (Py_ssize_t k = 0; kwargs != NULL && k < nkw; k++) {
            if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, k), args[nargs + k]) < 0) {
                Py_CLEAR(kwargs);
            }
        }
        if (kwargs == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    PyObject *made = PyType_Type.tp_call(callable, tuple, kwargs);
    Py_DECREF(tuple);
    Py_XDECREF(kwargs);
    return made;
}

static PyObject *
init_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static int
init_traverse(Init *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cls);
    Py_VISIT(self->names);
    Py_VISIT(self->defaults);
    return 0;
}

static int
init_clear(Init *self)
{
    Py_CLEAR(self->cls);
    Py_CLEAR(self->names);
    Py_CLEAR(self->defaults);
    return 0;
}

static void
init_dealloc(Init *self)
{
    PyObject_GC_UnTrack(self);
    init_clear(self);
    PyMem_Free(self->offsets);
    PyMem_Free(self->by_position);
    PyMem_Free(self->kinds);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
init_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *cls, *names, *by_position, *kinds, *defaults;
    int post_init;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!p", &PyType_Type, &cls, &PyTuple_Type, &names, &PyTuple_Type,
                          &by_position, &PyTuple_Type, &kinds, &PyTuple_Type, &defaults, &post_init)) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names), positional = PyTuple_GET_SIZE(by_position);
    if (n > MAX_FIELDS || PyTuple_GET_SIZE(kinds) != n || PyTuple_GET_SIZE(defaults) != n || positional > n) {
        PyErr_SetString(PyExc_ValueError, "Init: names, kinds and defaults must match (at most 64 fields)");
        return NULL;
    }
    Init *self = PyObject_GC_New(Init, type);
    if (self == NULL) {
        return NULL;
    }
    self->vectorcall = init_vectorcall;
    self->cls = (PyTypeObject *)Py_NewRef(cls);
    self->names = PyTuple_New(n);
    self->defaults = Py_NewRef(defaults);
    self->n = n;
    self->positional = positional;
    self->post_init = post_init;
    self->offsets = PyMem_New(Py_ssize_t, n > 0 ? n : 1);
    self->by_position = PyMem_New(Py_ssize_t, n > 0 ? n : 1);
    self->kinds = PyMem_New(unsigned char, n > 0 ? n : 1);
    PyObject_GC_Track(self);
    if (self->names == NULL || self->offsets == NULL || self->by_position == NULL || self->kinds == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < positional; i++) {
        Py_ssize_t field = PyLong_AsSsize_t(PyTuple_GET_ITEM(by_position, i));
        if (field < 0 || field >= n) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "Init: a positional parameter names a field by its index");
            }
            Py_DECREF(self);
            return NULL;
        }
        self->by_position[i] = field;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "Init: field names must be str");
            Py_DECREF(self);
            return NULL;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(self->names, i, name);
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(kinds, i));
        if (kind < 0 || kind > 2) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "Init: a kind is 0, 1 or 2");
            }
            Py_DECREF(self);
            return NULL;
        }
        self->kinds[i] = (unsigned char)kind;
        /* The field's slot: a member descriptor of ``cls`` (its own or a base's) holding an object. */
        PyObject *descr = _PyType_Lookup((PyTypeObject *)cls, name);
        /* ...and of ``cls`` or a base: another class's descriptor holds that class's offset (out of bounds here) */
        if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type
            || !PyType_IsSubtype((PyTypeObject *)cls, ((PyDescrObject *)descr)->d_type)) {
            PyErr_Format(PyExc_TypeError, "Init: field '%U' is not a slot", name);
            Py_DECREF(self);
            return NULL;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "Init: field '%U' is not a writable object slot", name);
            Py_DECREF(self);
            return NULL;
        }
        self->offsets[i] = member->offset;
    }
    if (Py_IS_TYPE(cls, &PyType_Type) && (((PyTypeObject *)cls)->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        ((PyTypeObject *)cls)->tp_vectorcall = class_vectorcall; /* the class's own calls skip type.__call__ */
    }
    return (PyObject *)self;
}

static PyObject *
init_call(PyObject *self, PyObject *args, PyObject *kwargs)
{
    return PyVectorcall_Call(self, args, kwargs);
}

static PyTypeObject InitType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "p2pnode._frozen.Init",
    .tp_basicsize = sizeof(Init),
    .tp_dealloc = (destructor)init_dealloc,
    .tp_vectorcall_offset = offsetof(Init, vectorcall),
    .tp_call = init_call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "A frozen slots dataclass's __init__, writing its slots by offset (see p2pnode/frozen.py).",
    .tp_traverse = (traverseproc)init_traverse,
    .tp_clear = (inquiry)init_clear,
    .tp_descr_get = init_descr_get,
    .tp_new = init_new,
};

static PyObject *
replace(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 1) {
        PyErr_SetString(PyExc_TypeError, "replace() takes one instance and keyword changes");
        return NULL;
    }
    PyObject *obj = args[0];
    PyTypeObject *cls = Py_TYPE(obj);
    Init *found = own_init(cls); /* only what ``cls(**fields)`` would build with object.__new__ and this Init */
    if (found == NULL) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    Init *init = (Init *)Py_NewRef(found); /* held through the allocation and __post_init__ */
    PyObject *values[MAX_FIELDS] = {NULL};
    PyObject *made = cls->tp_alloc(cls, 0);
    if (made == NULL) {
        goto done;
    }
    if (take_keywords(init, args + 1, kwnames, values) < 0) {
        Py_CLEAR(made);
        goto done;
    }
    /* the fields not changed, read from ``obj`` (borrowed: no Python code runs until every slot of ``made`` holds
     * its value) */
    for (Py_ssize_t i = 0; i < init->n; i++) {
        if (values[i] == NULL && (values[i] = SLOT(obj, init->offsets[i])) == NULL) {
            PyErr_Format(PyExc_AttributeError, "'%s' object has no attribute '%U'", cls->tp_name,
                         PyTuple_GET_ITEM(init->names, i));
            Py_CLEAR(made);
            goto done;
        }
    }
    if (fill(init, made, values) < 0) {
        Py_CLEAR(made);
    }
done:
    Py_DECREF(init);
    return made;
}

static PyMethodDef methods[] = {
    {"replace", (PyCFunction)(void (*)(void))replace, METH_FASTCALL | METH_KEYWORDS,
     "replace(obj, **changes) -> dataclasses.replace(obj, **changes) for a class with an Init, else NotImplemented"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_frozen", "A frozen slots dataclass's __init__ and replace in C (see p2pnode/frozen.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__frozen(void)
{
    if ((s_post_init = PyUnicode_InternFromString("__post_init__")) == NULL ||
        (s_init = PyUnicode_InternFromString("__init__")) == NULL) {
        return NULL;
    }
    if (PyType_Ready(&InitType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Init", (PyObject *)&InitType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
