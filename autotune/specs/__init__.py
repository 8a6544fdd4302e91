"""Specs: what the user trains (model), what they train it on (cluster, devices), in frozen dataclasses."""

from autotune.specs.catalogue import CATALOGUE, DeviceSpec, device_from_catalogue
from autotune.specs.cluster import ClusterSpec, Device, Link, NodeGroup, load_cluster, local_cluster
from autotune.specs.model import PRESETS, ModelSpec, load_model

__all__ = [
    "CATALOGUE", "DeviceSpec", "device_from_catalogue", "ClusterSpec", "Device", "Link", "NodeGroup",
    "load_cluster", "local_cluster", "PRESETS", "ModelSpec", "load_model",
]
