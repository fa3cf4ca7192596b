/* The strict-eager op in C, for its common case; everything else in the Python modules of `dispatch/`.

An op's dispatcher kernel (`registration.dispatcher_kernel`) is `entry`. It binds the call's arguments
to the schema, and when the op may take the fast path (no argument checks, writes nothing:
`Signature.fast_path_eligible`), strict eager is the mode, the call is the common case of `call.Call`
(`analyse` below: tpu tensors that are each exactly their storage's buffer, Scalars at their schema
default, plain static arguments) and its program was built and can be launched with its arrays alone
(`Program.direct_launch`), it launches that program and returns the new tensor. Any other call
continues in Python (`run.run_bound`), with the analysis already made.

The Python objects it uses are handed over once, by name, at import (`configure`, from
`registration.py`), which checks each one and every attribute read by name here, so that a rename on
the Python side fails at import with an error naming it rather than turning the fast path off.
In Python these steps were about half of a small strict op's time, beside the launch itself.

`tests/core/test_dispatch_fast_path.py` checks that `analyse` gives the key, operands and arrays the
general loop gives, and that the entry takes the calls it is for. See docs/design/native-hot-path.md.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* The argument kinds it tells apart: `signatures.py`'s values, which `configure` checks */
enum { TENSOR = 0, OPT_TENSOR = 1, SCALAR = 3, STATIC = 6 };

/* What `registration.py` hands over once, at import, by name (`configure`). */
static PyObject *tensor_type, *operand_type, *live, *hashable, *programs, *current_mode, *strict_mode,
    *buffer_module, *counters, *allocate, *run_bound, *matmul_precision, *s_strict_name, *array_type;
/* The attributes it reads by name, on tensors, buffers, programs and the buffer module; and counter keys */
static PyObject *s_data_ptr, *s_dtype, *s_is_neg, *s_is_conj, *s_is_contiguous, *s_shape;
static PyObject *s_device_index, *s_array, *s_direct_launch, *s_sharded, *s_ops_dispatched, *s_cache_hits,
    *s_cache_hits_by_mode;

/* Each object `configure` takes: its keyword, where it goes, and what it must be. */
enum { ANY, TYPE, DICT, LIST, CALLABLE, STR, MODULE };
static const struct {
    const char *name;
    PyObject **slot;
    int kind;
} BINDINGS[] = {
    {"tensor_type", &tensor_type, TYPE},       {"operand_type", &operand_type, TYPE},
    {"live", &live, DICT},                     {"hashable", &hashable, CALLABLE},
    {"programs", &programs, DICT},             {"current_mode", &current_mode, LIST},
    {"strict_mode", &strict_mode, ANY},        {"strict_counter_key", &s_strict_name, STR},
    {"buffer_module", &buffer_module, MODULE}, {"counters", &counters, DICT},
    {"allocate", &allocate, CALLABLE},         {"run_bound", &run_bound, CALLABLE},
    {"matmul_precision", &matmul_precision, CALLABLE}, {"array_type", &array_type, TYPE},
};
#define N_BINDINGS (sizeof BINDINGS / sizeof BINDINGS[0])
/* Keywords `configure` checks and does not keep: the classes whose attributes `entry` reads by name,
   the order of `Signature.entry_fields` and the argument kinds' values. */
static const char *const CHECKED_ONLY[] = {"buffer_type", "program_type", "signature_type", "entry_fields", "kinds"};
#define N_CHECKED_ONLY (sizeof CHECKED_ONLY / sizeof CHECKED_ONLY[0])
/* what `entry` unpacks from `Signature.entry_fields`, by position */
static const char *const ENTRY_FIELDS[] = {"names", "defaults", "kinds", "default_keys", "ident",
                                           "fast_path_eligible"};
#define N_ENTRY_FIELDS (sizeof ENTRY_FIELDS / sizeof ENTRY_FIELDS[0])

static PyObject *bound_error(const char *what, const char *name, const char *expected) {
    PyErr_Format(PyExc_TypeError, "hf_tpu.dispatch._entry.configure: %s '%s' %s", what, name, expected);
    return NULL;
}

/* Whether instances of `cls` have attribute `name`: a class attribute (slot, property, a dataclass
   field with a default), or a dataclass field. */
static int has_attribute(PyObject *cls, const char *name) {
    if (PyObject_HasAttrString(cls, name)) {
        return 1;
    }
    PyObject *fields = PyObject_GetAttrString(cls, "__dataclass_fields__");
    if (fields == NULL) {
        PyErr_Clear();
        return 0;
    }
    int found = PyDict_Check(fields) && PyDict_GetItemString(fields, name) != NULL;
    Py_DECREF(fields);
    return found;
}

static int check_attributes(PyObject *cls, const char *cls_name, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (!has_attribute(cls, names[i])) {
            PyErr_Format(PyExc_TypeError, "hf_tpu.dispatch._entry.configure: %s (%R) has no attribute '%s', which "
                         "the C entry reads by name", cls_name, cls, names[i]);
            return -1;
        }
    }
    return 0;
}

/* configure(**bindings): every name in BINDINGS and CHECKED_ONLY, nothing else; each of the expected
   type, and every attribute the entry reads by name present. All is checked before anything is kept,
   so a rename on the Python side fails here, at import, naming what is missing. */
static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError, "hf_tpu.dispatch._entry.configure takes keyword arguments only");
        return NULL;
    }
    Py_ssize_t given = kwargs ? PyDict_GET_SIZE(kwargs) : 0;
    PyObject *values[N_BINDINGS];
    for (size_t i = 0; i < N_BINDINGS; i++) {
        PyObject *v = kwargs ? PyDict_GetItemString(kwargs, BINDINGS[i].name) : NULL;
        if (v == NULL) {
            return bound_error("missing", BINDINGS[i].name, "(a rename on the Python side?)");
        }
        int ok = 1;
        const char *expected = "";
        switch (BINDINGS[i].kind) {
        case TYPE: ok = PyType_Check(v); expected = "must be a type"; break;
        case DICT: ok = PyDict_Check(v); expected = "must be a dict"; break;
        case LIST: ok = PyList_Check(v) && PyList_GET_SIZE(v) == 1; expected = "must be a list of one item"; break;
        case CALLABLE: ok = PyCallable_Check(v); expected = "must be callable"; break;
        case STR: ok = PyUnicode_Check(v); expected = "must be a str"; break;
        case MODULE: ok = PyModule_Check(v); expected = "must be a module"; break;
        }
        if (!ok) {
            return bound_error("argument", BINDINGS[i].name, expected);
        }
        values[i] = v;
    }
    PyObject *checked[N_CHECKED_ONLY];
    for (size_t i = 0; i < N_CHECKED_ONLY; i++) {
        checked[i] = kwargs ? PyDict_GetItemString(kwargs, CHECKED_ONLY[i]) : NULL;
        if (checked[i] == NULL) {
            return bound_error("missing", CHECKED_ONLY[i], "(a rename on the Python side?)");
        }
    }
    if (given != (Py_ssize_t)(N_BINDINGS + N_CHECKED_ONLY)) {
        PyErr_SetString(PyExc_TypeError, "hf_tpu.dispatch._entry.configure: unexpected keyword arguments (a name "
                        "the C entry does not know)");
        return NULL;
    }
    PyObject *buffer_type = checked[0], *program_type = checked[1], *signature_type = checked[2],
             *entry_fields = checked[3], *kinds = checked[4];
    if (!PyType_Check(buffer_type) || !PyType_Check(program_type) || !PyType_Check(signature_type)) {
        return bound_error("argument", "buffer_type, program_type, signature_type", "must be types");
    }
    /* operand_type: a tuple type of (tensor, buffer, view), built here with tp_alloc */
    if (!PyType_IsSubtype((PyTypeObject *)values[1], &PyTuple_Type)) {
        return bound_error("argument", "operand_type", "must be a tuple type (a NamedTuple)");
    }
    static const char *const tensor_attributes[] = {"data_ptr", "dtype", "is_neg", "is_conj", "is_contiguous",
                                                    "shape"};
    static const char *const buffer_attributes[] = {"dtype", "shape", "device_index", "_array"};
    static const char *const program_attributes[] = {"direct_launch"};
    static const char *const module_attributes[] = {"sharded_arrays_exist"};
    if (check_attributes(values[0], "tensor_type", tensor_attributes, 6) ||
        check_attributes(buffer_type, "buffer_type", buffer_attributes, 4) ||
        check_attributes(program_type, "program_type", program_attributes, 1) ||
        check_attributes(signature_type, "signature_type", ENTRY_FIELDS, N_ENTRY_FIELDS)) {
        return NULL;
    }
    if (!PyObject_HasAttrString(values[8], module_attributes[0])) {
        return bound_error("buffer_module has no attribute", module_attributes[0], "which the C entry reads by name");
    }
    /* the order `entry` unpacks */
    if (!PyTuple_Check(entry_fields) || PyTuple_GET_SIZE(entry_fields) != (Py_ssize_t)N_ENTRY_FIELDS) {
        return bound_error("argument", "entry_fields", "must be the tuple (names, defaults, kinds, default_keys, "
                           "ident, fast_path_eligible)");
    }
    for (size_t i = 0; i < N_ENTRY_FIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(entry_fields, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, ENTRY_FIELDS[i]) != 0) {
            return bound_error("entry_fields: expected", ENTRY_FIELDS[i], "at this position (the C entry unpacks "
                               "Signature.entry_fields by position)");
        }
    }
    /* the counters it increments */
    static const char *const counter_keys[] = {"ops_dispatched", "compile_cache_hits", "compile_cache_hits_by_mode"};
    for (int i = 0; i < 3; i++) {
        if (PyDict_GetItemString(values[9], counter_keys[i]) == NULL) {
            return bound_error("counters has no key", counter_keys[i], "which the C entry increments");
        }
    }
    static const char *const kind_names[] = {"TENSOR", "OPT_TENSOR", "SCALAR", "STATIC"};
    static const long kind_values[] = {TENSOR, OPT_TENSOR, SCALAR, STATIC};
    if (!PyDict_Check(kinds)) {
        return bound_error("argument", "kinds", "must be a dict of the argument kinds' values");
    }
    for (int i = 0; i < 4; i++) {
        PyObject *v = PyDict_GetItemString(kinds, kind_names[i]);
        if (v == NULL || !PyLong_CheckExact(v) || PyLong_AsLong(v) != kind_values[i]) {
            return bound_error("kinds:", kind_names[i], "differs from the C entry's value (signatures.py and "
                               "_entry.c must agree)");
        }
    }
    for (size_t i = 0; i < N_BINDINGS; i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*BINDINGS[i].slot, values[i]);
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

/* (key, operands, arrays, device_index) of a call in the common case, or None; NULL on an error. */
static PyObject *analysis(PyObject *kinds, PyObject *defaults, PyObject *default_keys, PyObject *values,
                          PyObject *ident, PyObject *precision) {
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
    Py_INCREF(ident);
    PyTuple_SET_ITEM(key, 0, ident);
    Py_INCREF(precision);
    PyTuple_SET_ITEM(key, 1, precision);
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

/* whole_arrays(values) -> (arrays, specs, device_index): where every one of `values` (a tuple) is a tpu tensor that
   is exactly its buffer, holding a computed array (of `array_type`, not a deferred one), all on one chip: each
   one's array and its (dtype, device index). Else None, for the general loop (`CompiledGraph._read_inputs`). A
   compiled graph reads its inputs, a model's parameters among them, so before every call. */
static PyObject *whole_arrays(PyObject *module, PyObject *values) {
    if (!PyTuple_Check(values) || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "whole_arrays(values: tuple), once configured");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    PyObject *arrays = PyList_New(n), *specs = PyList_New(n), *device_index = NULL;
    if (arrays == NULL || specs == NULL) {
        Py_XDECREF(arrays);
        Py_XDECREF(specs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(values, i);
        PyObject *buf = PyObject_TypeCheck(v, (PyTypeObject *)tensor_type) ? whole_buffer(v) : NULL;
        if (buf == NULL) {
            goto other_case;
        }
        PyObject *array = get(buf, s_array), *chip = get(buf, s_device_index), *dtype = get(buf, s_dtype);
        Py_DECREF(buf);
        PyObject *spec = NULL;
        if (array != NULL && chip != NULL && dtype != NULL && Py_TYPE(array) == (PyTypeObject *)array_type &&
            (device_index == NULL || PyObject_RichCompareBool(chip, device_index, Py_EQ) == 1)) {
            spec = PyTuple_Pack(2, dtype, chip);
        }
        if (spec == NULL) {
            Py_XDECREF(array);
            Py_XDECREF(chip);
            Py_XDECREF(dtype);
            goto other_case;
        }
        PyList_SET_ITEM(arrays, i, array); /* steals */
        PyList_SET_ITEM(specs, i, spec);
        Py_DECREF(dtype);
        if (device_index == NULL) {
            device_index = chip;
        } else {
            Py_DECREF(chip);
        }
    }
    PyObject *result = PyTuple_Pack(3, arrays, specs, device_index);
    Py_DECREF(arrays);
    Py_DECREF(specs);
    Py_DECREF(device_index);
    return result;
other_case:
    PyErr_Clear();
    Py_DECREF(arrays);
    Py_DECREF(specs);
    Py_XDECREF(device_index);
    Py_RETURN_NONE;
}

/* analyse(kinds, defaults, default_keys, values, ident, precision) */
static PyObject *analyse(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || tensor_type == NULL || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "analyse(kinds, defaults, default_keys, values, ident, precision)");
        return NULL;
    }
    return analysis(args[0], args[1], args[2], args[3], args[4], args[5]);
}

/* The schema's values: the positional arguments, then each omitted one from the keywords or its
   default: the one binding of a call, for every kernel and the fallback. */
static PyObject *bind(PyObject *names, PyObject *defaults, PyObject *const *args, Py_ssize_t npositional,
                      PyObject *kwnames) {
    Py_ssize_t n = PyTuple_GET_SIZE(names), total = npositional > n ? npositional : n;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *values = PyList_New(total);
    if (values == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < total; i++) {
        PyObject *v = i < npositional ? args[i] : NULL;
        for (Py_ssize_t k = 0; v == NULL && k < nkw; k++) { /* keyword values follow the positional ones */
            if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, k), PyTuple_GET_ITEM(names, i)) == 0) {
                v = args[npositional + k];
            }
        }
        if (v == NULL) {
            v = PyTuple_GET_ITEM(defaults, i);
        }
        Py_INCREF(v);
        PyList_SET_ITEM(values, i, v);
    }
    return values;
}

/* counters[name] += 1, where counters is `counters.counters` or one of its Counters */
static int count(PyObject *table, PyObject *name) {
    PyObject *old = PyDict_GetItemWithError(table, name); /* borrowed */
    if (old == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *new = PyLong_FromLongLong((old ? PyLong_AsLongLong(old) : 0) + 1);
    if (new == NULL) {
        return -1;
    }
    int failed = PyDict_SetItem(table, name, new);
    Py_DECREF(new);
    return failed;
}

/* The rest of the call in Python: run_bound(sig, values, analysed), `analysed` None where the call was
   not analysed, False where it is not the common case, else the analysis */
static PyObject *in_python(PyObject *sig, PyObject *values, PyObject *analysed) {
    PyObject *args[3] = {sig, values, analysed};
    return PyObject_Vectorcall(run_bound, args, 3, NULL);
}

/* entry(sig, fields, *args, **kwargs), with `fields` = `sig.entry_fields` = (names, defaults, kinds,
   default_keys, ident, fast_path_eligible): every tpu op's dispatcher kernel */
static PyObject *entry(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (nargs < 2 || run_bound == NULL || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != 6) {
        PyErr_SetString(PyExc_TypeError, "entry(sig, fields, *args, **kwargs)");
        return NULL;
    }
    PyObject *sig = args[0], *fields = args[1];
    PyObject *names = PyTuple_GET_ITEM(fields, 0), *defaults = PyTuple_GET_ITEM(fields, 1),
             *kinds = PyTuple_GET_ITEM(fields, 2), *default_keys = PyTuple_GET_ITEM(fields, 3),
             *ident = PyTuple_GET_ITEM(fields, 4), *eligible = PyTuple_GET_ITEM(fields, 5);
    PyObject *values = bind(names, defaults, args + 2, nargs - 2, kwnames);
    if (values == NULL) {
        return NULL;
    }
    if (eligible != Py_True || PyList_GET_ITEM(current_mode, 0) != strict_mode) {
        PyObject *result = in_python(sig, values, Py_None);
        Py_DECREF(values);
        return result;
    }
    PyObject *precision = PyObject_CallNoArgs(matmul_precision);
    PyObject *analysed = precision ? analysis(kinds, defaults, default_keys, values, ident, precision) : NULL;
    Py_XDECREF(precision);
    if (analysed == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *result = NULL, *direct = NULL, *launched = NULL;
    if (analysed == Py_None) {
        Py_SETREF(analysed, Py_NewRef(Py_False));
        goto python;
    }
    PyObject *program = PyDict_GetItemWithError(programs, PyTuple_GET_ITEM(analysed, 0)); /* borrowed */
    if (program == NULL) {
        goto python_or_error;
    }
    direct = PyObject_GetAttr(program, s_direct_launch);
    if (direct == NULL) {
        goto python_or_error;
    }
    PyObject *sharded = PyObject_GetAttr(buffer_module, s_sharded);
    int single_chip = sharded == Py_False;
    Py_XDECREF(sharded);
    if (direct == Py_None || !single_chip) {
        goto python_or_error;
    }
    PyObject *device_index = PyTuple_GET_ITEM(analysed, 3);
    PyObject *by_mode = PyDict_GetItemWithError(counters, s_cache_hits_by_mode); /* borrowed */
    if (device_index == Py_None || by_mode == NULL || !PyDict_Check(by_mode)) {
        goto python_or_error;
    }
    /* direct_launch = (jitted, shape, dtype): the program's launch and its one result's layout */
    PyObject *arrays = PyTuple_GET_ITEM(analysed, 2);
    launched = PyObject_Vectorcall(PyTuple_GET_ITEM(direct, 0), PySequence_Fast_ITEMS(arrays),
                                   PyList_GET_SIZE(arrays), NULL);
    if (launched == NULL) {
        /* an error XLA reports (out of memory): Python's launch makes it again and says it in
           PyTorch's terms */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            goto done;
        }
        PyErr_Clear();
        goto python;
    }
    if (count(counters, s_ops_dispatched) || count(counters, s_cache_hits) || count(by_mode, s_strict_name)) {
        goto done;
    }
    PyObject *allocate_args[4] = {PyTuple_GET_ITEM(direct, 1), PyTuple_GET_ITEM(direct, 2), device_index,
                                  launched};
    PyObject *made = PyObject_Vectorcall(allocate, allocate_args, 4, NULL); /* (tensor, buffer) */
    if (made != NULL) {
        result = PyTuple_GET_ITEM(made, 0);
        Py_INCREF(result);
        Py_DECREF(made);
    }
    goto done;
python_or_error:
    if (PyErr_Occurred()) {
        goto done;
    }
python:
    result = in_python(sig, values, analysed);
done:
    Py_XDECREF(launched);
    Py_XDECREF(direct);
    Py_DECREF(analysed);
    Py_DECREF(values);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(**bindings): what registration.py hands over once, by name, checked"},
    {"entry", (PyCFunction)(void (*)(void))entry, METH_FASTCALL | METH_KEYWORDS,
     "entry(sig, fields, *args, **kwargs): every tpu op's dispatcher kernel"},
    {"whole_arrays", (PyCFunction)whole_arrays, METH_O,
     "whole_arrays(values) -> (arrays, specs, device_index), or None for inputs the general loop reads"},
    {"analyse", (PyCFunction)(void (*)(void))analyse, METH_FASTCALL,
     "analyse(kinds, defaults, default_keys, values, ident, precision) -> (key, operands, arrays, "
     "device_index), or None for a call the general loop handles"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_entry", NULL, -1, methods};

PyMODINIT_FUNC PyInit__entry(void) {
    PyObject **names[] = {&s_data_ptr, &s_dtype, &s_is_neg, &s_is_conj, &s_is_contiguous, &s_shape,
                          &s_device_index, &s_array, &s_direct_launch, &s_sharded, &s_ops_dispatched,
                          &s_cache_hits, &s_cache_hits_by_mode};
    /* the same names `configure` checks */
    const char *strings[] = {"data_ptr", "dtype", "is_neg", "is_conj", "is_contiguous", "shape",
                             "device_index", "_array", "direct_launch", "sharded_arrays_exist", "ops_dispatched",
                             "compile_cache_hits", "compile_cache_hits_by_mode"};
    for (int i = 0; i < 13; i++) {
        *names[i] = PyUnicode_InternFromString(strings[i]);
        if (*names[i] == NULL) {
            return NULL;
        }
    }
    return PyModule_Create(&module);
}
