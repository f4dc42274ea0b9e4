"""poptorch/enums.py re-exports the compiler's enums under PopTorch's names: the member
a program passes is the one the compiler compares against, and files name them as
``poptorch.enums`` members."""
import pickle

import popart
import poptorch
from poptorch import enums
from poptorch._files import container
from popart_compiler import enums as compiler_enums


def test_every_public_enum_is_the_compilers_class():
    assert enums.__all__ == [n for n in compiler_enums.__all__ if n != "ExecutionMode"]
    for name in enums.__all__:
        assert getattr(enums, name) is getattr(compiler_enums, name)
        assert getattr(poptorch, name) is getattr(compiler_enums, name)
    assert popart.ReductionType is poptorch.ReductionType
    assert popart.DeviceConnectionType.OnDemand is poptorch.ConnectionType.OnDemand


def test_files_name_enums_by_poptorchs_module_and_read_them_back():
    tagged = container.encode({"mode": poptorch.OutputMode.EveryN}, "options")
    assert tagged == {"__dict__": [["mode", {"__enum__": "poptorch.enums:OutputMode",
                                             "name": "EveryN"}]]}
    assert container.decode(tagged)["mode"] is poptorch.OutputMode.EveryN


def test_members_pickle_to_themselves():
    for member in (poptorch.OutputMode.Sum, poptorch.OverlapMode.NoOverlap,
                   poptorch.CommGroupType.NoGrouping):
        assert pickle.loads(pickle.dumps(member)) is member
