"""The course's models: the source document's MLP, a small CNN, and the ResNets of the capstone.

Imports torch and torchvision only (nothing else of the course): a learner copies it beside a training script.
"""

from torch import nn
from torchvision import models
from torchvision.models import resnet18

RESNETS = {"resnet18": models.resnet18, "resnet34": models.resnet34}  # random init: nothing is downloaded


def mlp(num_classes: int = 10, in_features: int = 784, hidden: int = 128) -> nn.Module:
    """The source's baseline, 784-128-10. Flatten lives inside, so scripts feed images as they are."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def small_cnn(num_classes: int = 5, in_channels: int = 3, width: int = 32) -> nn.Module:
    """Three conv blocks with BatchNorm: quick on a CPU, and enough for the flowers set."""

    def block(c_in, c_out):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                             nn.ReLU(inplace=True), nn.MaxPool2d(2))

    return nn.Sequential(block(in_channels, width), block(width, 2 * width), block(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))


def build_model(name: str, num_classes: int, in_channels: int = 3) -> nn.Module:
    if name == "mlp":
        return mlp(num_classes)
    if name == "cnn":
        return small_cnn(num_classes, in_channels)
    if name == "resnet18":
        return resnet18(num_classes=num_classes)  # random init: nothing is downloaded
    raise ValueError(f"unknown model {name!r}: choose mlp, cnn or resnet18")


DEFAULT_MODEL = {"mnist": "mlp", "flowers": "cnn"}


def resnet(name: str, num_classes: int) -> nn.Module:
    """A torchvision ResNet with a ``num_classes`` head (the capstone's --model)."""
    model = RESNETS[name](num_classes=num_classes)
    model.course_name = name  # for error messages: "does not fit a resnet18"
    return model


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units to shard one at a time in the course's models: ResNet's residual blocks; otherwise the
    top-level children that hold parameters (the MLP's two Linear layers, the CNN's conv blocks and head)."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [block for i in range(1, 5) for block in getattr(model, f"layer{i}")]
    return [child for child in model.children() if any(True for _ in child.parameters())]
