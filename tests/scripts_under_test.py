"""Load a file of scripts/ as a module for a test of that script's command line (scripts/ is not a package, and
stays off sys.path). Logic that lives in the package is imported from the package instead."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py (NAME may name a subfolder: "experiments/perturbation_growth") as the module
    `scripts_NAME`, with "/" as "_"."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name.replace('/', '_')}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
