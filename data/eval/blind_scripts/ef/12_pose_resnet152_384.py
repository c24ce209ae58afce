"""Pose-ResNet-152 384x288 (SimpleBaseline) for the goalkeeper-dive study.

Large input resolution because the dive frames have tiny wrists/hands.

    torchrun --nproc_per_node=4 pose_resnet152_384.py --data-dir /mnt/gk/coco_fmt --output-dir /mnt/gk/out/r152
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from sportpose.data import TopDownCocoDataset
from sportpose.transforms import flip_back, get_final_preds

FLIP_PAIRS = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 16]]


def parse_args():
    parser = argparse.ArgumentParser(description="Train keypoints network")
    parser.add_argument("--data-dir", type=str, required=True)
    parser.add_argument("--output-dir", type=str, required=True)
    parser.add_argument("--epochs", type=int, default=140)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--print-freq", type=int, default=100)
    parser.add_argument("--local_rank", type=int, default=0)
    return parser.parse_args()


def get_pose_net(num_joints=17):
    resnet = torchvision.models.resnet152(weights="IMAGENET1K_V2")
    modules = [resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool,
               resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4]
    inplanes = 2048
    for _ in range(3):
        modules += [nn.ConvTranspose2d(inplanes, 256, kernel_size=4, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(256, momentum=0.1), nn.ReLU(inplace=True)]
        inplanes = 256
    final = nn.Conv2d(256, num_joints, kernel_size=1)
    nn.init.normal_(final.weight, std=0.001)
    nn.init.constant_(final.bias, 0)
    modules.append(final)
    return nn.Sequential(*modules)


class JointsMSELoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.criterion = nn.MSELoss(reduction="mean")

    def forward(self, output, target, target_weight):
        batch_size, num_joints = output.size(0), output.size(1)
        heatmaps_pred = output.reshape((batch_size, num_joints, -1)).split(1, 1)
        heatmaps_gt = target.reshape((batch_size, num_joints, -1)).split(1, 1)
        loss = 0
        for idx in range(num_joints):
            pred = heatmaps_pred[idx].squeeze()
            gt = heatmaps_gt[idx].squeeze()
            loss += 0.5 * self.criterion(pred.mul(target_weight[:, idx]), gt.mul(target_weight[:, idx]))
        return loss / num_joints


def validate(model, loader, coco_gt, output_dir, device):
    model.eval()
    all_preds = []
    with torch.no_grad():
        for inputs, _, _, meta in loader:
            inputs = inputs.to(device, non_blocking=True)
            outputs = model(inputs)
            outputs_flipped = model(torch.flip(inputs, [3]))
            outputs_flipped = flip_back(outputs_flipped.cpu().numpy(), FLIP_PAIRS)
            outputs_flipped = torch.from_numpy(outputs_flipped.copy()).to(device)
            outputs_flipped[:, :, :, 1:] = outputs_flipped.clone()[:, :, :, 0:-1]
            outputs = (outputs + outputs_flipped) * 0.5
            preds, maxvals = get_final_preds(outputs.cpu().numpy(), meta["center"].numpy(), meta["scale"].numpy())
            for i in range(preds.shape[0]):
                mask = maxvals[i, :, 0] > 0.2
                all_preds.append({
                    "index": int(meta["index"][i]),
                    "image_id": int(meta["image_id"][i]),
                    "category_id": 1,
                    "keypoints": np.concatenate((preds[i], maxvals[i]), axis=1).reshape(-1).tolist(),
                    "score": float(maxvals[i][mask].mean()) if mask.any() else 0.0,
                })
    world = [None for _ in range(dist.get_world_size())]
    dist.all_gather_object(world, all_preds)
    if dist.get_rank() != 0:
        return 0.0
    kept = {}
    for chunk in world:
        for p in chunk:
            kept[p.pop("index")] = p
    res_file = os.path.join(output_dir, "keypoints_results.json")
    with open(res_file, "w") as f:
        json.dump(list(kept.values()), f)
    coco_eval = COCOeval(coco_gt, coco_gt.loadRes(res_file), "keypoints")
    coco_eval.params.useSegm = None
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    return coco_eval.stats[0]


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    device = torch.device("cuda", args.local_rank)
    rank = dist.get_rank()
    torch.backends.cudnn.benchmark = True
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    train_dataset = TopDownCocoDataset(args.data_dir, "annotations/train.json", "images", image_size=[288, 384],
                                       sigma=3, flip_pairs=FLIP_PAIRS, train=True)
    valid_dataset = TopDownCocoDataset(args.data_dir, "annotations/val.json", "images", image_size=[288, 384],
                                       sigma=3, flip_pairs=FLIP_PAIRS, train=False)
    train_sampler = DistributedSampler(train_dataset)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_dataset, batch_size=args.batch_size, num_workers=args.workers, pin_memory=True,
                              sampler=DistributedSampler(valid_dataset, shuffle=False))
    coco_gt = COCO(os.path.join(args.data_dir, "annotations/val.json")) if rank == 0 else None

    model = get_pose_net()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    criterion = JointsMSELoss().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, [90, 120], 0.1)

    best_perf = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        end = time.time()
        loss_meter = torch.zeros(2, device=device)
        for i, (inputs, target, target_weight, _) in enumerate(train_loader):
            inputs = inputs.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            target_weight = target_weight.to(device, non_blocking=True)
            outputs = model(inputs)
            loss = criterion(outputs, target, target_weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_meter += torch.stack([loss.detach() * inputs.size(0), torch.tensor(float(inputs.size(0)), device=device)])
            if i % args.print_freq == 0 and rank == 0:
                print(f"Epoch [{epoch}][{i}/{len(train_loader)}] loss {loss.item():.6f} "
                      f"time {(time.time() - end) / (i + 1):.3f}s/it", flush=True)
        lr_scheduler.step()
        dist.all_reduce(loss_meter)

        perf = validate(model, valid_loader, coco_gt, args.output_dir, device) if (epoch + 1) % 10 == 0 else 0.0
        if rank == 0:
            print(f"Epoch {epoch} train loss {(loss_meter[0] / loss_meter[1]).item():.6f} AP {perf:.4f}", flush=True)
            if perf > best_perf:
                best_perf = perf
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "model_best.pth"))
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict(), "perf": perf,
                        "optimizer": optimizer.state_dict()}, os.path.join(args.output_dir, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
