"""Command-line helpers of train.py, the benchmarks and the scripts: bad input is one line naming it, exit 2.

``ArgumentParser`` is argparse's, whose errors are one line; the argument types below check a value when the
command line is read, before minutes of set-up or of benchmarking: comma-separated integers or names, a
recipe's name, a file to write at the end.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from mx_recipe.formats.recipe import NVFP4_RECIPES, RECIPES


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line, ``PROG: error: argument --shape: ...``, and exit 2 (the
    usage block is left to --help); --help prints the description (a script's docstring) with its line breaks."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_list(count: int | None = None, what: str = "") -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated positive integers, exactly ``count`` of them when given (``what`` names
    them in the error, e.g. "M,K,N")."""

    def parse(text: str) -> tuple[int, ...]:
        parts = [part.strip() for part in text.split(",")]
        if not all(part.isdigit() and int(part) > 0 for part in parts) or count not in (None, len(parts)):
            wanted = f"{what + ': ' if what else ''}{f'{count} ' if count else ''}positive integers"
            raise argparse.ArgumentTypeError(f"expected {wanted} separated by commas, got {text!r}")
        return tuple(int(part) for part in parts)

    return parse


def names(known: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names, each one of ``known``."""
    known = list(known)

    def parse(text: str) -> tuple[str, ...]:
        parts = tuple(part.strip() for part in text.split(","))
        unknown = [part for part in parts if part not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r} in {text!r}; known: {', '.join(known)}")
        return parts

    return parse


def recipe_name(nvfp4: bool = True, none: bool = False) -> Callable[[str], str]:
    """An argparse type: an MXRecipe's name, or an NVFP4Recipe's (``nvfp4``), or "none" for bf16 (``none``)."""
    known = [*RECIPES, *(NVFP4_RECIPES if nvfp4 else ()), *(["none"] if none else [])]

    def parse(text: str) -> str:
        if text not in known:
            raise argparse.ArgumentTypeError(f"unknown recipe {text!r}; known: {', '.join(known)}")
        return text

    return parse


def output_file(text: str) -> Path:
    """An argparse type: a file written when the command ends, checked when it starts: its folder exists and is
    writable, and its name fits the file system."""
    path = Path(text)
    folder = path.parent
    try:
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: no folder {folder}")
        if len(os.fsencode(path.name)) > os.pathconf(folder, "PC_NAME_MAX"):
            raise argparse.ArgumentTypeError(f"{text}: the name is longer than the file system allows")
    except OSError as e:  # a folder path too long, say
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror}") from None
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {folder}")
    return path
