"""Build hook: generate the gRPC stubs from proto/ before setuptools looks for packages
(radixserve.common.pb is generated, see radixserve.common.protogen). Runs for wheels and
editable installs alike; everything else about the package lives in pyproject.toml.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

_path = Path(__file__).parent / "services" / "common" / "protogen.py"
_spec = importlib.util.spec_from_file_location("_radixserve_protogen", _path)
assert _spec is not None and _spec.loader is not None
_protogen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_protogen)
if _protogen.PROTO_ROOT.is_dir():  # a source tree (an sdist without proto/ ships the stubs)
    _protogen.generate()

setup()
