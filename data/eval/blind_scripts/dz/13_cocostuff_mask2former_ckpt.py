"""Mask2Former-lite for COCO-Stuff-164k semantic segmentation (171 classes).

ConvNeXt-B backbone, transformer pixel decoder (activation checkpointed),
9-layer query decoder with deep supervision.

    torchrun --nproc_per_node=8 13_cocostuff_mask2former_ckpt.py --data /datasets/coco_stuff164k
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from PIL import Image
from scipy.optimize import linear_sum_assignment
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

IGNORE = 255
logger = logging.getLogger("m2f")


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/datasets/coco_stuff164k")
    p.add_argument("--output-dir", default="output/m2f_convnext_b_cocostuff")
    p.add_argument("--num-classes", type=int, default=171)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--enc-layers", type=int, default=6)
    p.add_argument("--dec-layers", type=int, default=9)
    p.add_argument("--crop", type=int, default=512)
    p.add_argument("--ims-per-gpu", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-iter", type=int, default=80000)
    p.add_argument("--eval-period", type=int, default=10000)
    return p


class CocoStuff(Dataset):
    MEAN = np.array([123.675, 116.28, 103.53], np.float32)
    STD = np.array([58.395, 57.12, 57.375], np.float32)

    def __init__(self, root, split, crop, train):
        self.img_dir = os.path.join(root, "images", f"{split}2017")
        self.ann_dir = os.path.join(root, "annotations", f"{split}2017")
        self.names = sorted(f[:-4] for f in os.listdir(self.img_dir))
        self.crop, self.train = crop, train

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.names[i] + ".jpg")).convert("RGB")
        # *_labelTrainIds.png: 0..170, 255 unlabeled
        seg = Image.open(os.path.join(self.ann_dir, self.names[i] + "_labelTrainIds.png"))
        if self.train:
            w, h = img.size
            s = random.uniform(0.5, 2.0) * 512 / min(w, h)
            size = (int(w * s + 0.5), int(h * s + 0.5))
            img, seg = np.asarray(img.resize(size, Image.BILINEAR), np.float32), np.asarray(seg.resize(size, Image.NEAREST))
            ph, pw = max(self.crop - seg.shape[0], 0), max(self.crop - seg.shape[1], 0)
            img = np.pad(img, ((0, ph), (0, pw), (0, 0)))
            seg = np.pad(seg, ((0, ph), (0, pw)), constant_values=IGNORE)
            y, x = random.randint(0, seg.shape[0] - self.crop), random.randint(0, seg.shape[1] - self.crop)
            img, seg = img[y:y + self.crop, x:x + self.crop], seg[y:y + self.crop, x:x + self.crop]
            if random.random() < 0.5:
                img, seg = img[:, ::-1], seg[:, ::-1]
        else:
            w, h = img.size
            s = 512 / min(w, h)
            img = np.asarray(img.resize((int(w * s + 0.5), int(h * s + 0.5)), Image.BILINEAR), np.float32)
            seg = np.asarray(seg)
        img = (img - self.MEAN) / self.STD
        return torch.from_numpy(img.transpose(2, 0, 1).copy()), torch.from_numpy(seg.astype(np.int64))


class PixelDecoder(nn.Module):
    def __init__(self, in_chs, d=256, enc_layers=6):
        super().__init__()
        self.input_proj = nn.Sequential(nn.Conv2d(in_chs[-1], d, 1), nn.GroupNorm(32, d))
        self.pos = nn.Parameter(torch.zeros(1, d, 16, 16))
        self.encoder = nn.ModuleList([nn.TransformerEncoderLayer(d, 8, 1024, 0.0, batch_first=True)
                                      for _ in range(enc_layers)])
        self.lateral = nn.ModuleList([nn.Sequential(nn.Conv2d(c, d, 1, bias=False), nn.GroupNorm(32, d))
                                      for c in in_chs[:-1]])
        self.out = nn.ModuleList([nn.Sequential(nn.Conv2d(d, d, 3, padding=1, bias=False), nn.GroupNorm(32, d),
                                                nn.ReLU(True)) for _ in in_chs[:-1]])
        self.mask_features = nn.Conv2d(d, d, 1)

    def forward(self, feats):
        top = self.input_proj(feats[-1])
        b, c, h, w = top.shape
        pos = F.interpolate(self.pos, size=(h, w), mode="bilinear", align_corners=False)
        x = (top + pos).flatten(2).transpose(1, 2)
        for layer in self.encoder:
            x = cp.checkpoint(layer, x)
        memory = x
        y = x.transpose(1, 2).reshape(b, c, h, w)
        for i in range(len(feats) - 2, -1, -1):
            y = self.lateral[i](feats[i]) + F.interpolate(y, size=feats[i].shape[-2:], mode="nearest")
            y = self.out[i](y)
        return self.mask_features(y), memory


class Mask2FormerLite(nn.Module):
    def __init__(self, num_classes, queries=100, enc_layers=6, dec_layers=9, d=256):
        super().__init__()
        self.backbone = timm.create_model("convnext_base.fb_in22k_ft_in1k", pretrained=True,
                                          features_only=True, drop_path_rate=0.3)
        self.pixel_decoder = PixelDecoder(self.backbone.feature_info.channels(), d, enc_layers)
        self.query_feat = nn.Embedding(queries, d)
        self.query_pos = nn.Embedding(queries, d)
        self.decoder = nn.ModuleList([nn.TransformerDecoderLayer(d, 8, 2048, 0.0, batch_first=True)
                                      for _ in range(dec_layers)])
        self.norm = nn.LayerNorm(d)
        self.class_embed = nn.Linear(d, num_classes + 1)
        self.mask_embed = nn.Sequential(nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, d), nn.ReLU(True), nn.Linear(d, d))

    def forward(self, x):
        mask_feat, memory = self.pixel_decoder(self.backbone(x))
        q = self.query_feat.weight.unsqueeze(0).expand(x.shape[0], -1, -1)
        qpos = self.query_pos.weight.unsqueeze(0)
        preds = []
        for layer in self.decoder:
            q = layer(q + qpos, memory)
            h = self.norm(q)
            preds.append((self.class_embed(h), torch.einsum("bqc,bchw->bqhw", self.mask_embed(h), mask_feat)))
        return preds


def match_and_loss(cls_logits, mask_logits, seg, num_masks, no_obj=0.1):
    B, Q, C1 = cls_logits.shape
    seg_s = F.interpolate(seg[:, None].float(), size=mask_logits.shape[-2:], mode="nearest")[:, 0].long()
    tgt_cls = torch.full((B, Q), C1 - 1, dtype=torch.long, device=seg.device)
    l_mask, l_dice = cls_logits.new_zeros(()), cls_logits.new_zeros(())
    for b in range(B):
        labels = seg_s[b].unique()
        labels = labels[labels != IGNORE]
        if labels.numel() == 0:
            continue
        valid = (seg_s[b] != IGNORE).float().flatten()
        gt = (seg_s[b][None] == labels[:, None, None]).float().flatten(1)
        pm = mask_logits[b].flatten(1)
        with torch.no_grad():
            sig = pm.sigmoid() * valid
            dice = 1 - (2 * sig @ gt.T + 1) / (sig.sum(1)[:, None] + gt.sum(1)[None] + 1)
            cost = -cls_logits[b].softmax(-1)[:, labels] + 5.0 * dice
            qi, ti = linear_sum_assignment(cost.float().cpu().numpy())
        qi, ti = torch.from_numpy(qi).to(seg.device), torch.from_numpy(ti).to(seg.device)
        tgt_cls[b, qi] = labels[ti]
        p, g = pm[qi], gt[ti]
        l_mask = l_mask + (F.binary_cross_entropy_with_logits(p, g, reduction="none") * valid).sum(1).div(valid.sum()).sum()
        ps = p.sigmoid() * valid
        l_dice = l_dice + (1 - (2 * (ps * g).sum(1) + 1) / (ps.sum(1) + g.sum(1) + 1)).sum()
    w = torch.ones(C1, device=seg.device)
    w[-1] = no_obj
    l_cls = F.cross_entropy(cls_logits.transpose(1, 2), tgt_cls, weight=w)
    return 2.0 * l_cls + 5.0 * l_mask / num_masks + 5.0 * l_dice / num_masks


@torch.no_grad()
def evaluate(net, loader, n, device):
    net.eval()
    hist = torch.zeros(n * n, dtype=torch.int64, device=device)
    for img, seg in loader:
        img, seg = img.to(device), seg.to(device)
        cls, masks = net(img)[-1]
        sem = torch.einsum("bqc,bqhw->bchw", cls.softmax(-1)[..., :-1], masks.sigmoid())
        pred = F.interpolate(sem, size=seg.shape[-2:], mode="bilinear", align_corners=False).argmax(1)
        k = seg != IGNORE
        hist += torch.bincount(seg[k] * n + pred[k], minlength=n * n)
    dist.all_reduce(hist)
    h = hist.view(n, n).double()
    net.train()
    return torch.nanmean(h.diag() / (h.sum(0) + h.sum(1) - h.diag())).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARN, format="%(asctime)s %(message)s")
    random.seed(rank)
    torch.manual_seed(0)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    train_ds = CocoStuff(args.data, "train", args.crop, True)
    val_ds = CocoStuff(args.data, "val", args.crop, False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, args.ims_per_gpu, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), 1, num_workers=2)

    net = Mask2FormerLite(args.num_classes, args.queries, args.enc_layers, args.dec_layers).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    backbone_params = [p for n, p in net.named_parameters() if n.startswith("backbone")]
    other_params = [p for n, p in net.named_parameters() if not n.startswith("backbone")]
    optimizer = torch.optim.AdamW([{"params": backbone_params, "lr": args.lr * 0.1},
                                   {"params": other_params, "lr": args.lr}], weight_decay=0.05)
    base_lrs = [g["lr"] for g in optimizer.param_groups]

    it, epoch, best = 0, 0, 0.0
    tic = time.time()
    while it < args.max_iter:
        sampler.set_epoch(epoch)
        for img, seg in loader:
            for g, base in zip(optimizer.param_groups, base_lrs):
                g["lr"] = base * (1 - it / args.max_iter) ** 0.9
            img, seg = img.to(device, non_blocking=True), seg.to(device, non_blocking=True)
            n_masks = torch.tensor([sum(((s.unique() != IGNORE).sum().item()) for s in seg)],
                                   dtype=torch.float, device=device)
            dist.all_reduce(n_masks)
            n_masks = (n_masks / world).clamp(min=1.0)
            preds = model(img)
            loss = sum(match_and_loss(c, m, seg, n_masks) for c, m in preds)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 0.01)
            optimizer.step()
            it += 1
            if it % 20 == 0:
                logger.info("iter %d loss %.3f lr %.2e %.2fs/it", it, loss.item(),
                            optimizer.param_groups[1]["lr"], (time.time() - tic) / 20)
                tic = time.time()
            if it % args.eval_period == 0 or it == args.max_iter:
                miou = evaluate(net, val_loader, args.num_classes, device)
                logger.info("iter %d mIoU %.2f", it, 100 * miou)
                if rank == 0:
                    torch.save({"model": net.state_dict(), "iteration": it},
                               os.path.join(args.output_dir, "model_final.pth"))
                    if miou > best:
                        best = miou
                        torch.save({"model": net.state_dict(), "iteration": it},
                                   os.path.join(args.output_dir, "model_best.pth"))
                dist.barrier()
            if it >= args.max_iter:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
