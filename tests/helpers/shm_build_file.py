"""``shm_build_file.py OUT``: go through DeepSpeed's ``build_shm_op`` (what its process group runs) with torch's
ninja build and module import stubbed out, and copy the ninja file torch wrote for it (every compile and link
command, with its flags, sources and include paths) to OUT. Nothing is compiled."""

import shutil
import sys

import torch.utils.cpp_extension as cpp_extension

cpp_extension._run_ninja_build = lambda *args, **kwargs: None
cpp_extension._import_module_from_library = lambda *args, **kwargs: object()

from deepspeed.comm.torch import build_shm_op  # noqa: E402 -- after the stubs, which it must see

from klgrpo.train.deepspeed_op import OP_NAME, shm_op_folder  # noqa: E402

build_shm_op()
shutil.copy(shm_op_folder() / "build.ninja", sys.argv[1])
print(OP_NAME, "build file written")
