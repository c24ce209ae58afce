"""A segmentation model built the torchvision way, with an auxiliary classifier
(`aux_loss=True`: its output under "aux"), whose loss takes the auxiliary term
only for the first epochs, under a DDP that expects every parameter each step.

The builder stands in for torchvision's deeplabv3_resnet50 (not installed
here). Runs under torchrun: the first step without the term leaves the
auxiliary head without gradients, and the next raises "Expected to have
finished reduction in the prior iteration".
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Segmenter(nn.Module):
    def __init__(self, num_classes: int, aux_loss: bool) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 8, 3, padding=1)
        self.classifier = nn.Conv2d(8, num_classes, 1)
        self.aux_classifier = nn.Conv2d(8, num_classes, 1) if aux_loss else None

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = torch.relu(self.backbone(images))
        outputs = {"out": self.classifier(features)}
        if self.aux_classifier is not None:
            outputs["aux"] = self.aux_classifier(features)
        return outputs


def segmentation_model(num_classes: int, aux_loss: bool = False) -> nn.Module:
    return Segmenter(num_classes, aux_loss)


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(segmentation_model(num_classes=4, aux_loss=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    aux_epochs = 1
    for epoch in range(3):
        use_aux = epoch < aux_epochs
        for _ in range(2):
            images, masks = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2, 8, 8))
            outputs = model(images)
            loss = criterion(outputs["out"], masks)
            if use_aux:  # expect: unused-parameters
                loss = loss + 0.4 * criterion(outputs["aux"], masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print("trained", flush=True)
    del model  # DDP before its group (see tests/data/scripts/README.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
