"""The one way the adapters and the patches wrap a library's function (`hf_tpu.wrapping`): once,
keeping the original, whatever the function is (a method, a classmethod, a property, a module's function, an
object's method); and installing every adapter again wraps nothing twice."""

import importlib
import inspect
import sys
import types

import pytest

from hf_tpu import integrations
from hf_tpu.wrapping import ORIGINAL, is_tpu, original_of, wrap_once


def _calls(tag):
    """A wrap that records each call as `tag`."""

    def wrap(original):
        def wrapper(*args, **kwargs):
            return (tag, original(*args, **kwargs))

        return wrapper

    return wrap


class _Library:
    def method(self):
        return "method"

    @classmethod
    def build(cls):
        return cls.__name__

    @property
    def size(self):
        return self._size

    @size.setter
    def size(self, value):
        self._size = value


def test_a_method_is_wrapped_once_and_keeps_its_original():
    class Owner(_Library):
        method = _Library.method

    original = Owner.__dict__["method"]
    assert wrap_once(Owner, "method", _calls("first"))
    assert not wrap_once(Owner, "method", _calls("second"))
    assert Owner().method() == ("first", "method")
    assert original_of(Owner.__dict__["method"]) is original
    assert getattr(Owner.__dict__["method"], ORIGINAL) is original
    assert original_of(original) is None


def test_an_inherited_method_is_wrapped_on_the_class_itself():
    class Owner(_Library):
        pass

    wrap_once(Owner, "method", _calls("wrapped"))
    assert Owner().method() == ("wrapped", "method")
    assert _Library().method() == "method"


def test_a_classmethod_stays_one():
    class Owner(_Library):
        build = _Library.__dict__["build"]

    def wrap(original):
        return classmethod(lambda cls: ("wrapped", original.__func__(cls)))

    assert wrap_once(Owner, "build", wrap)
    assert not wrap_once(Owner, "build", wrap)
    assert Owner.build() == ("wrapped", "Owner")
    assert original_of(inspect.getattr_static(Owner, "build")) is _Library.__dict__["build"]


def test_a_property_keeps_its_setter_and_wraps_its_getter():
    class Owner(_Library):
        size = _Library.__dict__["size"]

    assert wrap_once(Owner, "size", _calls("read"))
    assert not wrap_once(Owner, "size", _calls("again"))
    owner = Owner()
    owner.size = 3
    assert owner.size == ("read", 3)
    assert original_of(Owner.__dict__["size"]) is _Library.__dict__["size"].fget


def test_a_module_function_and_an_object_method():
    module = types.ModuleType("library")
    module.function = lambda: "function"
    wrap_once(module, "function", _calls("wrapped"))
    wrap_once(module, "function", _calls("again"))
    assert module.function() == ("wrapped", "function")

    thing = _Library()
    wrap_once(thing, "method", _calls("this one"))
    assert thing.method() == ("this one", "method")
    assert _Library().method() == "method"


@pytest.mark.parametrize("device, expected", [("tpu", True), ("tpu:1", True), (None, False), ("cpu", False),
                                              ("auto", False), ({"": "tpu"}, False)])
def test_is_tpu(device, expected):
    assert is_tpu(device) is expected


def _library_attributes() -> dict:
    """(module or class, name) -> the object it holds, over every loaded module of the adapted libraries."""
    libraries = {name.split(".")[0] for name in integrations.ADAPTERS}
    held = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in libraries:
            continue
        for name, value in list(vars(module).items()):
            held[module_name, name] = value
            if isinstance(value, type) and value.__module__ == module_name:
                held.update({(f"{module_name}.{name}", attribute): member
                             for attribute, member in list(vars(value).items())})
    return held


def test_installing_the_adapters_again_wraps_nothing_twice():
    """Each adapter installs again after a reload or when a library imports a patched module anew;
    then each function keeps the one wrapper it has."""
    for module_name in integrations.ADAPTERS:
        importlib.import_module(module_name)
    before = _library_attributes()
    integrations.activate()  # installs every adapter whose library is imported: all of them, again
    after = _library_attributes()
    assert [key for key, value in before.items() if after.get(key) is not value] == []
