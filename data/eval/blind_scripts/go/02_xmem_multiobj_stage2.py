"""XMem-style stage-2 training (YouTube-VOS + DAVIS clips) with multi-object interaction.

Usage:
    torchrun --standalone --nproc_per_node=8 02_xmem_multiobj_stage2.py --config configs/s2.yaml
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torchvision.models import ResNet18_Weights, ResNet50_Weights, resnet18, resnet50
from torchvision.ops import FrozenBatchNorm2d

DEFAULTS = dict(
    ytvos_root="/datasets/YouTube2019/train", davis_root="/datasets/DAVIS/2017/trainval",
    out_dir="saves/xmem_s2", num_frames=8, max_objects=3, max_skip=15, size=384,
    batch_size=4, num_workers=8, iterations=110000, lr=1e-5, weight_decay=0.05,
    steps=[80000], gamma=0.1, grad_ckpt=True, save_every=10000, eval_every=10000,
    mem_every=5, max_mem=10, wandb_project="xmem-ft", init="", seed=14159,
)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def load_config():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=None)
    p.add_argument("opts", nargs="*", help="key=value overrides")
    a = p.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    for kv in a.opts:
        k, v = kv.split("=", 1)
        cfg[k] = yaml.safe_load(v)
    return cfg


class VOSClips(Dataset):
    def __init__(self, root, cfg, repeat=1):
        res = "480p" if os.path.isdir(os.path.join(root, "JPEGImages", "480p")) else ""  # DAVIS layout
        self.im_root, self.gt_root = os.path.join(root, "JPEGImages", res), os.path.join(root, "Annotations", res)
        self.cfg = cfg
        videos = sorted(os.listdir(self.im_root))
        if res:  # DAVIS trainval: keep the train split only
            train = set(open(os.path.join(root, "ImageSets", "2017", "train.txt")).read().split())
            videos = [v for v in videos if v in train]
        self.videos = [v for v in videos if len(os.listdir(os.path.join(self.im_root, v))) >= cfg["num_frames"]] * repeat

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, idx):
        vid, c = self.videos[idx], self.cfg
        names = sorted(os.listdir(os.path.join(self.im_root, vid)))
        S, T, K = c["size"], c["num_frames"], c["max_objects"]
        for _ in range(5):
            start = random.randint(0, len(names) - T)
            idxs = sorted(random.sample(range(start, min(len(names), start + T * c["max_skip"])), T))
            scale = random.uniform(1.0, 1.5)
            ims, gts = [], []
            for i in idxs:
                im = Image.open(os.path.join(self.im_root, vid, names[i])).convert("RGB")
                gt = Image.open(os.path.join(self.gt_root, vid, names[i][:-4] + ".png")).convert("P")
                w, h = im.size
                nw, nh = max(S, int(w * S / min(w, h) * scale)), max(S, int(h * S / min(w, h) * scale))
                if not ims:
                    x0, y0 = random.randint(0, nw - S), random.randint(0, nh - S)
                ims.append(np.asarray(im.resize((nw, nh), Image.BILINEAR))[y0:y0 + S, x0:x0 + S])
                gts.append(np.asarray(gt.resize((nw, nh), Image.NEAREST))[y0:y0 + S, x0:x0 + S])
            labels = [l for l in np.unique(gts[0]) if l not in (0, 255)]
            if labels:
                break
        labels = random.sample(labels, min(K, len(labels)))
        frames = torch.from_numpy(np.stack(ims)).permute(0, 3, 1, 2).float().div(255)
        frames = (frames - MEAN) / STD
        gts = np.stack(gts)
        masks = torch.zeros(T, K, S, S)
        valid = torch.zeros(K, dtype=torch.bool)
        for k, l in enumerate(labels):
            masks[:, k] = torch.from_numpy(gts == l).float()
            valid[k] = True
        return frames, masks, valid


def resnet_trunk(depth, in_ch=3):
    net = (resnet50 if depth == 50 else resnet18)(
        weights=ResNet50_Weights.IMAGENET1K_V2 if depth == 50 else ResNet18_Weights.IMAGENET1K_V1,
        norm_layer=FrozenBatchNorm2d)
    if in_ch != 3:
        conv = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[:, :3] = net.conv1.weight
        net.conv1 = conv
    return net


class KeyEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        net = resnet_trunk(50)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.layer1, self.layer2, self.layer3 = net.layer1, net.layer2, net.layer3

    def forward(self, x):
        f4 = self.layer1(self.stem(x))
        f8 = self.layer2(f4)
        return self.layer3(f8), f8, f4


class ValueEncoder(nn.Module):
    def __init__(self, value_dim=512):
        super().__init__()
        net = resnet_trunk(18, in_ch=5)
        self.trunk = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3)
        self.fuse = nn.Sequential(nn.Conv2d(1024 + 256, value_dim, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(value_dim, value_dim, 3, padding=1))

    def forward(self, image, f16, mask, others):
        x = self.trunk(torch.cat([image, mask, others], 1))
        return self.fuse(torch.cat([x, f16], 1))


class ObjectInteraction(nn.Module):
    """Lets objects of the same clip exchange a pooled summary (helps with similar-looking instances)."""

    def __init__(self, dim=512, heads=8):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, readout, valid):
        tok = self.norm(readout.mean(dim=(-1, -2)))
        pad = ~valid & valid.any(1, keepdim=True)  # clips without objects attend to everything
        mixed, _ = self.attn(tok, tok, tok, key_padding_mask=pad, need_weights=False)
        return readout + torch.tanh(self.gate(mixed))[..., None, None]


class UpBlock(nn.Module):
    def __init__(self, skip_c, up_c, out_c):
        super().__init__()
        self.skip = nn.Conv2d(skip_c, up_c, 3, padding=1)
        self.out = nn.Sequential(nn.ReLU(), nn.Conv2d(up_c, out_c, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(out_c, out_c, 3, padding=1))

    def forward(self, skip, up, K):
        skip = self.skip(skip).unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1)
        return self.out(skip + F.interpolate(up, scale_factor=2, mode="bilinear", align_corners=False))


class XMemNet(nn.Module):
    def __init__(self, key_dim=64, value_dim=512, grad_ckpt=True):
        super().__init__()
        self.key_encoder = KeyEncoder()
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.shrinkage = nn.Conv2d(1024, 1, 3, padding=1)
        self.selection = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.value_encoder = ValueEncoder(value_dim)
        self.interaction = ObjectInteraction(value_dim)
        self.fuser = nn.Sequential(nn.Conv2d(1024 + value_dim, 512, 3, padding=1), nn.ReLU(inplace=True),
                                   nn.Conv2d(512, 512, 3, padding=1))
        self.up16_8, self.up8_4 = UpBlock(512, 512, 256), UpBlock(256, 256, 256)
        self.pred = nn.Conv2d(256, 1, 3, padding=1)
        self.grad_ckpt = grad_ckpt

    def encode_key(self, frames):
        f16, f8, f4 = self.key_encoder(frames)
        return f16, f8, f4, self.key_proj(f16), self.shrinkage(f16) ** 2 + 1, torch.sigmoid(self.selection(f16))

    def encode_value(self, image, f16, prob):
        B, K = prob.shape[:2]
        others = prob.sum(1, keepdim=True) - prob
        args = (image.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1),
                f16.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1),
                prob.flatten(0, 1).unsqueeze(1), others.flatten(0, 1).unsqueeze(1))
        if self.grad_ckpt and self.training:
            v = checkpoint(self.value_encoder, *args, use_reentrant=False)
        else:
            v = self.value_encoder(*args)
        return v.view(B, K, *v.shape[1:])

    @staticmethod
    def read_memory(mk, ms, mv, qk, qe):
        a_sq = mk.pow(2).transpose(1, 2) @ qe
        two_ab = 2 * (mk.transpose(1, 2) @ (qk * qe))
        b_sq = (qe * qk.pow(2)).sum(1, keepdim=True)
        aff = F.softmax((-a_sq + two_ab - b_sq) * ms.transpose(1, 2) / math.sqrt(mk.shape[1]), dim=1)
        B, K, CV, _ = mv.shape
        return (mv.flatten(1, 2) @ aff).view(B, K, CV, -1)

    def segment(self, f16, f8, f4, readout, valid):
        B, K = readout.shape[:2]
        if valid.sum(1).max() > 1:
            readout = self.interaction(readout, valid)
        g = torch.cat([f16.unsqueeze(1).expand(-1, K, -1, -1, -1), readout], 2).flatten(0, 1)
        g = self.up8_4(f4, self.up16_8(f8, self.fuser(g), K), K)
        logits = F.interpolate(self.pred(F.relu(g)), scale_factor=4, mode="bilinear", align_corners=False)
        return logits.view(B, K, *logits.shape[-2:])

    def forward(self, frames, masks, valid):
        B, T, K = frames.shape[0], frames.shape[1], masks.shape[2]
        feats = [x.view(B, T, *x.shape[1:]) for x in self.encode_key(frames.flatten(0, 1))]
        f16, f8, f4, key, shrink, sel = feats
        h, w = key.shape[-2:]
        vmask = valid[..., None, None].float()
        mem_k, mem_s, mem_v = [key[:, 0]], [shrink[:, 0]], [self.encode_value(frames[:, 0], f16[:, 0], masks[:, 0] * vmask)]
        out = []
        for t in range(1, T):
            mv = torch.stack(mem_v, 3).flatten(3)
            readout = self.read_memory(torch.stack(mem_k, 2).flatten(2), torch.stack(mem_s, 2).flatten(2), mv,
                                       key[:, t].flatten(2), sel[:, t].flatten(2)).view(B, K, -1, h, w)
            logits = self.segment(f16[:, t], f8[:, t], f4[:, t], readout, valid)
            out.append(logits)
            if t < T - 1:
                mem_k.append(key[:, t])
                mem_s.append(shrink[:, t])
                mem_v.append(self.encode_value(frames[:, t], f16[:, t], torch.sigmoid(logits) * vmask))
        return torch.stack(out, 1)


def clip_loss(logits, gt, valid):
    vm = valid[:, None, :, None, None].float()
    prob = torch.sigmoid(logits) * vm
    agg = torch.cat([torch.prod(1 - prob, 2, keepdim=True), prob], 2).clamp(1e-7, 1 - 1e-7)
    agg = torch.log(agg / (1 - agg))
    labels = torch.cat([torch.full_like(gt[:, :, :1], 0.5), gt], 2).argmax(2)
    ce = F.cross_entropy(agg.flatten(0, 1), labels.flatten(0, 1))
    p, g = prob.flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    dice = (dice * vm[..., 0, 0]).sum() / (vm.sum() * dice.shape[1]).clamp(min=1)
    return ce + dice, ce.detach(), dice.detach()


def gather_variable(values, world):
    n = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, device=values.device)
    padded[: values.numel()] = values
    out = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(s.item())] for o, s in zip(out, sizes)])


@torch.no_grad()
def evaluate_davis(net, cfg, device, rank, world):
    root = cfg["davis_root"]
    videos = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    scores = []
    net.eval()
    for vid in videos[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", vid)))
        ims = [np.asarray(Image.open(os.path.join(root, "JPEGImages/480p", vid, n)).convert("RGB")) for n in names]
        gts = np.stack([np.asarray(Image.open(os.path.join(root, "Annotations/480p", vid, n[:-4] + ".png"))) for n in names])
        K = int(gts[0].max())
        valid = torch.ones(1, K, dtype=torch.bool, device=device)
        frames = ((torch.from_numpy(np.stack(ims)).permute(0, 3, 1, 2).float().div(255) - MEAN) / STD).to(device)
        H, W = frames.shape[-2:]
        ph, pw = (16 - H % 16) % 16, (16 - W % 16) % 16
        frames = F.pad(frames, (0, pw, 0, ph), mode="replicate")
        first = torch.stack([torch.from_numpy(gts[0] == k + 1) for k in range(K)]).float().to(device)
        first = F.pad(first, (0, pw, 0, ph))[None]
        f16, f8, f4, key, shrink, sel = net.encode_key(frames[:1])
        mem = [(key, shrink, net.encode_value(frames[:1], f16, first))]
        preds = [torch.from_numpy(gts[0]).long().to(device)]
        for t in range(1, len(names)):
            f16, f8, f4, key, shrink, sel = net.encode_key(frames[t:t + 1])
            mk, ms, mv = (torch.stack([m[i] for m in mem], 2 + (i == 2)).flatten(2 + (i == 2)) for i in range(3))
            readout = net.read_memory(mk, ms, mv, key.flatten(2), sel.flatten(2)).view(1, K, -1, *key.shape[-2:])
            prob = torch.sigmoid(net.segment(f16, f8, f4, readout, valid))
            pred = torch.where(prob.max(1).values > 0.5, prob.argmax(1) + 1, 0)[0, :H, :W]
            preds.append(pred)
            if t % cfg["mem_every"] == 0:
                mem.append((key, shrink, net.encode_value(frames[t:t + 1], f16, prob)))
                mem = mem[:1] + mem[1:][-(cfg["max_mem"] - 1):]
        pred = torch.stack(preds).cpu().numpy()
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            inter, union = (p & g).sum((1, 2)), (p | g).sum((1, 2))
            scores.append(float(np.mean(np.where(union > 0, inter / np.maximum(union, 1), 1.0))))
    net.train()
    return gather_variable(torch.tensor(scores, device=device), world)


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg["seed"])
    random.seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)

    net = XMemNet(grad_ckpt=cfg["grad_ckpt"]).to(device)
    if cfg["init"]:
        sd = torch.load(cfg["init"], map_location="cpu")
        sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
        missing, unexpected = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"init from {cfg['init']}: missing={missing} unexpected={unexpected}")
    # the interaction block is skipped for single-object batches
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    train_set = ConcatDataset([VOSClips(cfg["ytvos_root"], cfg), VOSClips(cfg["davis_root"], cfg, repeat=5)])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True, persistent_workers=True)
    optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()),
                                  lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg["steps"], cfg["gamma"])
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        wandb.init(project=cfg["wandb_project"], config=cfg, dir=cfg["out_dir"])

    it, epoch = 0, 0
    while it < cfg["iterations"]:
        sampler.set_epoch(epoch)
        for frames, masks, valid in loader:
            frames, masks, valid = frames.to(device), masks.to(device), valid.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(frames, masks, valid)
            loss, ce, dice = clip_loss(logits.float(), masks[:, 1:], valid)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                wandb.log({"loss": loss.item(), "ce": ce.item(), "dice": dice.item(),
                           "lr": scheduler.get_last_lr()[0]}, step=it)
            if it % cfg["eval_every"] == 0:
                scores = evaluate_davis(net, cfg, device, rank, world)
                if rank == 0:
                    wandb.log({"davis17_val/J": scores.mean().item(), "num_objects": scores.numel()}, step=it)
            if it % cfg["save_every"] == 0 and rank == 0:
                torch.save({"image_encoder": net.key_encoder.state_dict(),
                            "memory": {k: v for k, v in net.state_dict().items() if not k.startswith("key_encoder.")},
                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "it": it},
                           os.path.join(cfg["out_dir"], f"xmem_{it}.pth"))
            if it >= cfg["iterations"]:
                break
        epoch += 1

    if rank == 0:
        torch.save(net.state_dict(), os.path.join(cfg["out_dir"], "xmem_final.pth"))
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
