"""Composable, immutable, versioned filesystem layers and the images stacked from them."""

from dsec.layers.builders import (
    DebianRecipe,
    build_debian_layer,
    build_recipe_image,
    import_dir_layer,
    import_oci_archive,
    import_tarball_layer,
    list_recipes,
    load_recipe,
)
from dsec.layers.store import Image, Layer, LayerRef, LayerStore, shift_tree, tree_digest

__all__ = [
    "DebianRecipe",
    "Image",
    "Layer",
    "LayerRef",
    "LayerStore",
    "build_debian_layer",
    "build_recipe_image",
    "import_dir_layer",
    "import_oci_archive",
    "import_tarball_layer",
    "list_recipes",
    "load_recipe",
    "shift_tree",
    "tree_digest",
]
