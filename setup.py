"""Packaging beyond pyproject.toml: install ``zeroshard-as-deepspeed.pth`` beside the package.

At interpreter start that file installs ``import deepspeed`` -> zeroshard when ``ZEROSHARD_AS_DEEPSPEED`` is set
(for ranks started by ``torchrun``, ``accelerate launch`` or SLURM); without the variable it does nothing. A
``.pth`` file only works at the top of site-packages, so it goes to the wheel's root: from ``build_py`` for
regular installs, and into the editable wheel for ``pip install -e``.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "zeroshard-as-deepspeed.pth"
SOURCE = os.path.join("zeroshard", "compat", PTH)


class BuildWithPth(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            self.copy_file(SOURCE, os.path.join(self.build_lib, PTH))


class EditableWithPth(editable_wheel):
    def _select_strategy(self, name, tag, build_lib):
        return _AddPth(super()._select_strategy(name, tag, build_lib))


class _AddPth:
    """Wraps setuptools' editable strategy: writes what it writes, plus the .pth file."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(SOURCE) as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
