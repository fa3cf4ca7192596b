/* The common case of `dispatch._Call`, in C: an op called with tpu tensors that are each exactly their
storage's buffer (every op result), schema defaults for its Scalars, and plain static arguments.

Strict eager pays the analysis of a call on every op; in Python it was about a fifth of a small op.
This function returns the same key, operands and arrays that `_Call`'s general loop builds, or None
for anything else (views, CPU scalars, Python numbers, tensor lists, generators, device mismatches):
the general loop then handles the call, errors included. `tests/core/test_dispatch_fast_path.py`
checks that both give the same key. See docs/design/native-hot-path.md.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* dispatch.py's argument kinds */
enum { TENSOR = 0, OPT_TENSOR = 1, SCALAR = 3, STATIC = 6 };

static PyObject *tensor_type, *operand_type, *live, *hashable;
static PyObject *s_data_ptr, *s_dtype, *s_is_neg, *s_is_conj, *s_is_contiguous, *s_shape;
static PyObject *s_device_index, *s_array;

/* configure(torch.Tensor, dispatch._Operand, allocator.live, dispatch._hashable), once at import */
static PyObject *configure(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "configure(tensor_type, operand_type, live, hashable)");
        return NULL;
    }
    PyObject **slots[] = {&tensor_type, &operand_type, &live, &hashable};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

/* A method call without arguments, or NULL (the error cleared: the general loop will see it again). */
static PyObject *call0(PyObject *self, PyObject *name) {
    PyObject *result = PyObject_CallMethodNoArgs(self, name);
    if (result == NULL) {
        PyErr_Clear();
    }
    return result;
}

/* 1 true, 0 false, -1 not answerable (error cleared) */
static int call_bool(PyObject *self, PyObject *name) {
    PyObject *result = call0(self, name);
    if (result == NULL) {
        return -1;
    }
    int truth = PyObject_IsTrue(result);
    Py_DECREF(result);
    if (truth < 0) {
        PyErr_Clear();
    }
    return truth;
}

static PyObject *get(PyObject *self, PyObject *name) {
    PyObject *result = PyObject_GetAttr(self, name);
    if (result == NULL) {
        PyErr_Clear();
    }
    return result;
}

/* The buffer `t` is exactly (a new reference), or NULL: found by its data pointer (so at offset 0),
   not negated or conjugated, contiguous, of its buffer's dtype and shape (`buffer.view_of` is None). */
static PyObject *whole_buffer(PyObject *t) {
    PyObject *pointer = call0(t, s_data_ptr);
    if (pointer == NULL) {
        return NULL;
    }
    PyObject *buf = PyDict_GetItemWithError(live, pointer); /* borrowed */
    Py_DECREF(pointer);
    if (buf == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_INCREF(buf);
    if (call_bool(t, s_is_neg) != 0 || call_bool(t, s_is_conj) != 0 || call_bool(t, s_is_contiguous) != 1) {
        goto no;
    }
    PyObject *dtype = get(t, s_dtype), *buf_dtype = get(buf, s_dtype);
    int same = dtype != NULL && dtype == buf_dtype; /* torch.dtype objects are singletons */
    Py_XDECREF(dtype);
    Py_XDECREF(buf_dtype);
    if (!same) {
        goto no;
    }
    PyObject *shape = get(t, s_shape), *buf_shape = get(buf, s_shape);
    same = shape != NULL && buf_shape != NULL ? PyObject_RichCompareBool(shape, buf_shape, Py_EQ) : 0;
    Py_XDECREF(shape);
    Py_XDECREF(buf_shape);
    if (same == 1) {
        return buf;
    }
    PyErr_Clear();
no:
    Py_DECREF(buf);
    return NULL;
}

/* The key part of a Scalar argument equal to its schema default, or NULL. Same type and value, and
   for floats the same bits: -0.0 equals 0.0 in Python yet is another program. */
static PyObject *default_key(PyObject *v, PyObject *def, PyObject *def_key) {
    if (def == Py_None || Py_TYPE(v) != Py_TYPE(def)) {
        return NULL;
    }
    if (PyFloat_CheckExact(v)) {
        double a = PyFloat_AS_DOUBLE(v), b = PyFloat_AS_DOUBLE(def);
        if (memcmp(&a, &b, sizeof a) != 0) {
            return NULL;
        }
    } else if (!(PyLong_CheckExact(v) || PyBool_Check(v)) || PyObject_RichCompareBool(v, def, Py_EQ) != 1) {
        PyErr_Clear();
        return NULL;
    }
    Py_INCREF(def_key);
    return def_key;
}

/* analyse(kinds, defaults, default_keys, values, ident, precision) -> (key, operands, arrays,
   device_index) or None */
static PyObject *analyse(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "analyse(kinds, defaults, default_keys, values, ident, precision)");
        return NULL;
    }
    PyObject *kinds = args[0], *defaults = args[1], *default_keys = args[2], *values = args[3];
    Py_ssize_t n = PyTuple_GET_SIZE(kinds);
    if (!PyList_Check(values) || PyList_GET_SIZE(values) < n) {
        Py_RETURN_NONE;
    }
    PyObject *key = PyTuple_New(n + 2), *operands = PyList_New(0), *arrays = PyList_New(0);
    PyObject *device_index = Py_None;
    Py_INCREF(device_index);
    if (key == NULL || operands == NULL || arrays == NULL) {
        goto error;
    }
    Py_INCREF(args[4]);
    PyTuple_SET_ITEM(key, 0, args[4]);
    Py_INCREF(args[5]);
    PyTuple_SET_ITEM(key, 1, args[5]);
    for (Py_ssize_t i = 0; i < n; i++) {
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(kinds, i));
        PyObject *v = PyList_GET_ITEM(values, i), *part = NULL;
        if ((kind == TENSOR || kind == OPT_TENSOR) && v == Py_None) {
            Py_INCREF(Py_None);
            part = Py_None;
        } else if ((kind == TENSOR || kind == OPT_TENSOR) && PyObject_TypeCheck(v, (PyTypeObject *)tensor_type)) {
            PyObject *buf = whole_buffer(v);
            if (buf == NULL) {
                goto other_case;
            }
            PyObject *chip = get(buf, s_device_index), *array = get(buf, s_array), *shape = get(buf, s_shape),
                     *dtype = get(buf, s_dtype);
            int same_chip = chip != NULL && (device_index == Py_None ||
                                             PyObject_RichCompareBool(chip, device_index, Py_EQ) == 1);
            PyObject *operand = NULL;
            if (same_chip && array != NULL && shape != NULL && dtype != NULL) {
                Py_SETREF(device_index, chip);
                chip = NULL;
                part = PyTuple_Pack(4, shape, dtype, Py_None, array == Py_None ? Py_True : Py_False);
                operand = ((PyTypeObject *)operand_type)->tp_alloc((PyTypeObject *)operand_type, 3);
                if (operand != NULL) {
                    Py_INCREF(v);
                    PyTuple_SET_ITEM(operand, 0, v);
                    Py_INCREF(buf);
                    PyTuple_SET_ITEM(operand, 1, buf);
                    Py_INCREF(Py_None);
                    PyTuple_SET_ITEM(operand, 2, Py_None);
                }
            }
            int appended = part != NULL && operand != NULL && PyList_Append(operands, operand) == 0 &&
                           PyList_Append(arrays, array) == 0;
            Py_XDECREF(operand);
            Py_XDECREF(chip);
            Py_XDECREF(array);
            Py_XDECREF(shape);
            Py_XDECREF(dtype);
            Py_DECREF(buf);
            if (!appended) {
                Py_XDECREF(part);
                goto other_case;
            }
        } else if (kind == SCALAR) {
            part = default_key(v, PyTuple_GET_ITEM(defaults, i), PyTuple_GET_ITEM(default_keys, i));
        } else if (kind == STATIC) {
            part = PyObject_CallOneArg(hashable, v);
        }
        if (part == NULL) {
            goto other_case;
        }
        PyTuple_SET_ITEM(key, i + 2, part);
    }
    PyObject *result = PyTuple_Pack(4, key, operands, arrays, device_index);
    Py_DECREF(key);
    Py_DECREF(operands);
    Py_DECREF(arrays);
    Py_DECREF(device_index);
    return result;
other_case:
    PyErr_Clear();
    Py_DECREF(key);
    Py_DECREF(operands);
    Py_DECREF(arrays);
    Py_DECREF(device_index);
    Py_RETURN_NONE;
error:
    Py_XDECREF(key);
    Py_XDECREF(operands);
    Py_XDECREF(arrays);
    Py_DECREF(device_index);
    return NULL;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(torch.Tensor, dispatch._Operand, allocator.live, dispatch._hashable)"},
    {"analyse", (PyCFunction)(void (*)(void))analyse, METH_FASTCALL,
     "analyse(kinds, defaults, default_keys, values, ident, precision) -> (key, operands, arrays, "
     "device_index), or None for a call the general loop handles"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_operands", NULL, -1, methods};

PyMODINIT_FUNC PyInit__operands(void) {
    PyObject **names[] = {&s_data_ptr, &s_dtype, &s_is_neg, &s_is_conj, &s_is_contiguous,
                          &s_shape, &s_device_index, &s_array};
    const char *strings[] = {"data_ptr", "dtype", "is_neg", "is_conj", "is_contiguous",
                             "shape", "device_index", "_array"};
    for (int i = 0; i < 8; i++) {
        *names[i] = PyUnicode_InternFromString(strings[i]);
        if (*names[i] == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&module);
}
