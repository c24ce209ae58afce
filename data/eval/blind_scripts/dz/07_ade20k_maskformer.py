"""MaskFormer-style semantic segmentation (R-50 + FPN pixel decoder + 6-layer
transformer decoder, 100 queries) on ADE20K.

Decoder layers are activation-checkpointed to fit 2 x 512^2 per GPU on 16GB cards.

    torchrun --nproc_per_node=8 07_ade20k_maskformer.py --data-root /datasets/ADEChallengeData2016
"""
import argparse
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
NUM_CLASSES = 150


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/datasets/ADEChallengeData2016")
    p.add_argument("--output", default="output/maskformer_r50_ade")
    p.add_argument("--ims-per-gpu", type=int, default=2)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--backbone-mult", type=float, default=0.1)
    p.add_argument("--max-iter", type=int, default=160000)
    p.add_argument("--eval-period", type=int, default=5000)
    p.add_argument("--num-queries", type=int, default=100)
    p.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false")
    return p.parse_args()


class ADESemSeg(Dataset):
    def __init__(self, root, split, crop, train):
        d = "training" if split == "train" else "validation"
        self.img_dir, self.ann_dir = f"{root}/images/{d}", f"{root}/annotations/{d}"
        self.names = sorted(n[:-4] for n in os.listdir(self.img_dir) if n.endswith(".jpg"))
        self.crop, self.train = crop, train
        self.mean = np.array([123.675, 116.28, 103.53], np.float32)
        self.std = np.array([58.395, 57.12, 57.375], np.float32)

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(f"{self.img_dir}/{self.names[i]}.jpg").convert("RGB")
        ann = Image.open(f"{self.ann_dir}/{self.names[i]}.png")
        w, h = img.size
        s = (random.uniform(0.5, 2.0) if self.train else 1.0) * 512 / min(w, h)
        size = (int(w * s + 0.5), int(h * s + 0.5))
        img = np.asarray(img.resize(size, Image.BILINEAR), np.float32)
        ann = np.asarray(ann.resize(size, Image.NEAREST) if self.train else ann, np.int64) - 1
        ann[ann < 0] = IGNORE  # 0 = "other" in ADE annotations
        if self.train:
            ph, pw = max(self.crop - img.shape[0], 0), max(self.crop - img.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            ann = np.pad(ann, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, img.shape[0] - self.crop), random.randint(0, img.shape[1] - self.crop)
            img, ann = img[y:y + self.crop, x:x + self.crop], ann[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, ann = img[:, ::-1], ann[:, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(ann.copy())


class MaskFormer(nn.Module):
    def __init__(self, num_classes, num_queries=100, d=256, dec_layers=6, grad_ckpt=False):
        super().__init__()
        self.num_queries, self.grad_ckpt = num_queries, grad_ckpt
        self.backbone = timm.create_model("resnet50", pretrained=True, features_only=True, out_indices=(1, 2, 3, 4))
        chs = self.backbone.feature_info.channels()
        self.lateral = nn.ModuleList([nn.Conv2d(c, d, 1) for c in chs])
        self.fpn_out = nn.ModuleList([nn.Sequential(nn.Conv2d(d, d, 3, padding=1, bias=False),
                                                    nn.GroupNorm(32, d), nn.ReLU(True)) for _ in chs])
        self.mask_feat = nn.Conv2d(d, d, 3, padding=1)
        self.query = nn.Embedding(num_queries, d)
        self.pos = nn.Parameter(torch.zeros(1, 32 * 32, d))
        self.layers = nn.ModuleList([nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True)
                                     for _ in range(dec_layers)])
        self.dec_norm = nn.LayerNorm(d)
        self.cls_head = nn.Linear(d, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, d))

    def forward(self, x):
        feats = self.backbone(x)
        y = None
        for i in reversed(range(len(feats))):
            lat = self.lateral[i](feats[i])
            y = lat if y is None else lat + F.interpolate(y, size=lat.shape[-2:], mode="nearest")
            y = self.fpn_out[i](y)
            if i == len(feats) - 1:
                mem = y.flatten(2).transpose(1, 2)
        mask_features = self.mask_feat(y)
        pos = F.interpolate(self.pos.transpose(1, 2).reshape(1, -1, 32, 32), size=feats[-1].shape[-2:],
                            mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
        mem = mem + pos
        q = self.query.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        outs = []
        for layer in self.layers:
            if self.grad_ckpt and self.training:
                q = checkpoint(layer, q, mem, use_reentrant=False)
            else:
                q = layer(q, mem)
            h = self.dec_norm(q)
            masks = torch.einsum("bqc,bchw->bqhw", self.mask_embed(h), mask_features)
            outs.append({"logits": self.cls_head(h), "masks": masks})
        return outs


def semseg_to_targets(ann):
    targets = []
    for a in ann:
        cls = a.unique()
        cls = cls[cls != IGNORE]
        targets.append({"labels": cls, "masks": (a[None] == cls[:, None, None]).float(), "valid": a != IGNORE})
    return targets


def dice_cost(pm, tm):
    pm = pm.sigmoid().flatten(1)
    tm = tm.flatten(1)
    num = 2 * pm @ tm.T
    return 1 - (num + 1) / (pm.sum(-1)[:, None] + tm.sum(-1)[None] + 1)


def set_criterion(out, targets, num_masks, eos_coef=0.1):
    logits, masks = out["logits"], out["masks"]
    B, Q, C1 = logits.shape
    h, w = masks.shape[-2:]
    cls_target = torch.full((B, Q), C1 - 1, dtype=torch.long, device=logits.device)
    loss_mask = logits.new_zeros(())
    loss_dice = logits.new_zeros(())
    for b, t in enumerate(targets):
        tm = F.interpolate(t["masks"][None], size=(h, w), mode="nearest")[0]
        valid = F.interpolate(t["valid"][None, None].float(), size=(h, w), mode="nearest")[0, 0]
        with torch.no_grad():
            prob = logits[b].softmax(-1)
            cost = -prob[:, t["labels"]] + dice_cost(masks[b] * valid, tm)
            qi, ti = linear_sum_assignment(cost.cpu())
        qi, ti = torch.as_tensor(qi, device=logits.device), torch.as_tensor(ti, device=logits.device)
        cls_target[b, qi] = t["labels"][ti]
        pm, gm = masks[b, qi], tm[ti]
        bce = F.binary_cross_entropy_with_logits(pm, gm, reduction="none")
        loss_mask = loss_mask + (bce * valid).sum((1, 2)).div(valid.sum().clamp(min=1)).sum()
        loss_dice = loss_dice + dice_cost(pm * valid, gm).diag().sum()
    weight = torch.ones(C1, device=logits.device)
    weight[-1] = eos_coef
    loss_ce = F.cross_entropy(logits.transpose(1, 2), cls_target, weight=weight)
    return loss_ce + 20.0 * loss_mask / num_masks + 1.0 * loss_dice / num_masks


@torch.no_grad()
def semantic_inference(net, img, out_size):
    out = net(img)[-1]
    prob = out["logits"].softmax(-1)[..., :-1]
    seg = torch.einsum("bqc,bqhw->bchw", prob, out["masks"].sigmoid())
    return F.interpolate(seg, size=out_size, mode="bilinear", align_corners=False)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hist = torch.zeros(NUM_CLASSES ** 2, dtype=torch.int64, device=device)
    for img, ann in loader:
        img, ann = img.to(device), ann.to(device)
        pred = semantic_inference(net, img, ann.shape[-2:]).argmax(1)
        k = ann != IGNORE
        hist += torch.bincount(ann[k] * NUM_CLASSES + pred[k], minlength=NUM_CLASSES ** 2)
    dist.all_reduce(hist)
    hist = hist.view(NUM_CLASSES, NUM_CLASSES).double()
    iou = hist.diag() / (hist.sum(0) + hist.sum(1) - hist.diag())
    net.train()
    return torch.nanmean(iou).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(42)
    os.makedirs(args.output, exist_ok=True)

    train_ds = ADESemSeg(args.data_root, "train", args.crop, True)
    val_ds = ADESemSeg(args.data_root, "val", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.ims_per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = MaskFormer(NUM_CLASSES, args.num_queries, grad_ckpt=args.grad_ckpt)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=False)
    if rank == 0:
        print(f"{sum(p.numel() for p in net.parameters()) / 1e6:.1f}M params, {net.num_queries} queries")

    bb = [p for n, p in net.named_parameters() if n.startswith("backbone.")]
    rest = [p for n, p in net.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.AdamW([{"params": bb, "lr": args.lr * args.backbone_mult},
                                   {"params": rest, "lr": args.lr}], weight_decay=1e-4)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    it, epoch, best = 0, 0, 0.0
    t0 = time.time()
    while it < args.max_iter:
        sampler.set_epoch(epoch)
        for img, ann in loader:
            for g, blr in zip(optimizer.param_groups, base_lrs):
                g["lr"] = blr * (1 - it / args.max_iter) ** 0.9
            img, ann = img.to(device, non_blocking=True), ann.to(device, non_blocking=True)
            targets = semseg_to_targets(ann)
            # normalise mask losses by the average number of GT masks over all GPUs
            num_masks = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
            dist.all_reduce(num_masks)
            num_masks = (num_masks / world).clamp(min=1.0)
            outs = model(img)
            loss = sum(set_criterion(o, targets, num_masks) for o in outs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            optimizer.step()
            it += 1
            if rank == 0 and it % 20 == 0:
                print(f"iter {it} loss {loss.item():.3f} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                t0 = time.time()
            if it % args.eval_period == 0 or it == args.max_iter:
                miou = evaluate(net, val_loader, device)
                if rank == 0:
                    print(f"iter {it} mIoU {miou * 100:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "iter": it}, f"{args.output}/model_final.pth")
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "iter": it}, f"{args.output}/model_best.pth")
                dist.barrier()
            if it >= args.max_iter:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
