"""Image-level active learning for Cityscapes semantic segmentation (DeepLabV3-R50).

Acquisition score = mean pixel entropy of the image (computed at half resolution).
Runs on 2 nodes x 8 GPUs; data and outputs live on the shared Lustre file system.

    srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv_id=$SLURM_JOB_ID --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
        17_al_cityscapes_seg_multinode.py --root /lustre/datasets/cityscapes \
        --out /lustre/$USER/al/cityscapes_entropy
"""
import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF

IGNORE = 255
NUM_CLASSES = 19
# Cityscapes label id -> train id
ID_TO_TRAINID = np.full(256, IGNORE, dtype=np.uint8)
for _id, _tid in {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11,
                  25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}.items():
    ID_TO_TRAINID[_id] = _tid
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init", type=int, default=300)
    p.add_argument("--query", type=int, default=150)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=8000, help="optimisation steps per round")
    p.add_argument("--bs", type=int, default=2, help="images per GPU")
    p.add_argument("--crop", type=int, default=768)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class CityscapesSeg(Dataset):
    def __init__(self, root, split, train, crop=768):
        self.base = torchvision.datasets.Cityscapes(root, split=split, mode="fine", target_type="semantic")
        self.train, self.crop = train, crop

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, lbl = self.base[i]
        lbl = torch.from_numpy(ID_TO_TRAINID[np.asarray(lbl)]).long()
        img = TF.to_tensor(img)
        if self.train:
            scale = random.uniform(0.5, 1.5)
            h, w = int(1024 * scale), int(2048 * scale)
            img = TF.resize(img, [h, w], antialias=True)
            lbl = TF.resize(lbl[None], [h, w], interpolation=TF.InterpolationMode.NEAREST)[0]
            pad_h, pad_w = max(0, self.crop - h), max(0, self.crop - w)
            if pad_h or pad_w:
                img = F.pad(img, (0, pad_w, 0, pad_h))
                lbl = F.pad(lbl, (0, pad_w, 0, pad_h), value=IGNORE)
            top = random.randint(0, img.shape[1] - self.crop)
            left = random.randint(0, img.shape[2] - self.crop)
            img = img[:, top:top + self.crop, left:left + self.crop]
            lbl = lbl[top:top + self.crop, left:left + self.crop]
            if random.random() < 0.5:
                img, lbl = img.flip(-1), lbl.flip(-1)
        return TF.normalize(img, MEAN, STD), lbl, i


def build_model():
    m = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=torchvision.models.ResNet50_Weights.IMAGENET1K_V2,
        num_classes=NUM_CLASSES, aux_loss=True)
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


@torch.no_grad()
def image_entropy(net, ds, idx, device):
    sub = Subset(ds, idx.tolist())
    loader = DataLoader(sub, batch_size=4, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=4, pin_memory=True)
    net.eval()
    scores, ids = [], []
    for x, _, i in loader:
        x = F.interpolate(x.to(device, non_blocking=True), scale_factor=0.5, mode="bilinear", align_corners=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x)["out"]
        p = logits.float().softmax(1)
        scores.append(-(p * p.clamp_min(1e-8).log()).sum(1).mean(dim=(1, 2)))
        ids.append(i.to(device))
    scores, ids = torch.cat(scores), torch.cat(ids)
    s_all = [torch.empty_like(scores) for _ in range(dist.get_world_size())]
    i_all = [torch.empty_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(s_all, scores)
    dist.all_gather(i_all, ids)
    return torch.cat(s_all).cpu(), torch.cat(i_all).cpu()


@torch.no_grad()
def miou(net, ds, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(Subset(ds, list(range(rank, len(ds), world))), batch_size=2, num_workers=4)
    net.eval()
    conf = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.long, device=device)
    for x, y, _ in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x)["out"].argmax(1)
        keep = y != IGNORE
        conf += torch.bincount(y[keep] * NUM_CLASSES + pred[keep],
                               minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    dist.all_reduce(conf)
    conf = conf.double()
    iou = conf.diag() / (conf.sum(0) + conf.sum(1) - conf.diag()).clamp_min(1)
    return iou.mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)  # crop / flip augmentation only

    train_ds = CityscapesSeg(args.root, "train", train=True, crop=args.crop)
    pool_ds = CityscapesSeg(args.root, "train", train=False)
    val_ds = CityscapesSeg(args.root, "val", train=False)

    state_file = os.path.join(args.out, "al_state.json")
    if os.path.exists(state_file):
        with open(state_file) as f:
            st = json.load(f)
        labelled, start = np.asarray(st["labelled"], dtype=np.int64), st["round"] + 1
    else:
        labelled = np.sort(np.random.default_rng(args.seed).choice(len(train_ds), args.init, replace=False))
        start = 0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for rnd in range(start, args.rounds):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        model = DDP(build_model().to(device), device_ids=[local_rank])
        opt = torch.optim.SGD(model.parameters(), lr=args.lr * world * args.bs / 16, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=args.iters, power=0.9)
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=args.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=args.bs, sampler=sampler, num_workers=6,
                            pin_memory=True, drop_last=True)

        step, epoch = 0, 0
        model.train()
        while step < args.iters:
            sampler.set_epoch(epoch)
            for x, y, _ in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = model(x)
                    loss = F.cross_entropy(out["out"], y, ignore_index=IGNORE) + \
                        0.4 * F.cross_entropy(out["aux"], y, ignore_index=IGNORE)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                if step >= args.iters:
                    break
            epoch += 1

        val_miou = miou(model.module, val_ds, device)

        unlabelled = np.setdiff1d(np.arange(len(pool_ds)), labelled)
        scores, ids = image_entropy(model.module, pool_ds, unlabelled, device)
        ids, first = np.unique(ids.numpy(), return_index=True)
        picked = ids[np.argsort(-scores.numpy()[first], kind="stable")[: args.query]]
        labelled = np.union1d(labelled, picked)

        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, f"deeplab_round{rnd}.pth"))
            tmp = state_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"round": rnd, "labelled": labelled.tolist(), "val_miou": val_miou}, f)
            os.replace(tmp, state_file)
            with open(os.path.join(args.out, "miou.jsonl"), "a") as f:
                f.write(json.dumps({"round": rnd, "n_labelled": len(sub), "miou": val_miou,
                                    "hours": (time.time() - t0) / 3600}) + "\n")
            print(f"round {rnd}: {len(sub)} labelled images, val mIoU {val_miou:.4f}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
