"""Making layers: Debian roots with mmdebstrap, and imports of directories, tarballs and
OCI / docker archives.

Every builder fills a staging directory with *container-side* ownership and commits it with
``shift=True``, so the store applies the uid/gid offset exactly once.
"""

from __future__ import annotations

from dsec.layers.builders.common import (
    Progress,
)
from dsec.layers.builders.debian import (
    DebianRecipe,
    _trim_debian_tree,
    build_debian_layer,
    build_recipe_image,
    list_recipes,
    load_recipe,
)
from dsec.layers.builders.oci import (
    import_oci_archive,
)
from dsec.layers.builders.tar import (
    import_tarball_layer,
)
from dsec.layers.builders.tree import (
    import_dir_layer,
)

__all__ = [
    "DebianRecipe",
    "Progress",
    "_trim_debian_tree",
    "build_debian_layer",
    "build_recipe_image",
    "import_dir_layer",
    "import_oci_archive",
    "import_tarball_layer",
    "list_recipes",
    "load_recipe",
]
