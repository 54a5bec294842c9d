"""Composable, immutable, versioned filesystem layers and the images stacked from them."""

from dsec.layers.builders.debian import (
    DebianRecipe,
    build_debian_layer,
    build_recipe_image,
    list_recipes,
    load_recipe,
)
from dsec.layers.builders.oci import import_oci_archive
from dsec.layers.builders.tar import import_tarball_layer, unpack_layer_stream
from dsec.layers.builders.tree import import_dir_layer
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
    "unpack_layer_stream",
]
