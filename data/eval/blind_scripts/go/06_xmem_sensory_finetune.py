"""Fine-tune an XMem-style network (working + sensory memory) on DAVIS/YouTube-VOS clips.

    torchrun --nproc_per_node=8 06_xmem_sensory_finetune.py --init weights/XMem-s012.pth --exp davis_ft
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.models import ResNet18_Weights, ResNet50_Weights, resnet18, resnet50
from torchvision.ops import FrozenBatchNorm2d

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--exp", default="ft")
    p.add_argument("--yv_root", default="/data/YouTube/train_480p")
    p.add_argument("--davis_root", default="/data/DAVIS/2017/trainval")
    p.add_argument("--init", default="")
    p.add_argument("--iterations", type=int, default=60000)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--num_frames", type=int, default=8)
    p.add_argument("--max_objects", type=int, default=3)
    p.add_argument("--max_skip", type=int, default=5)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--hidden_dim", type=int, default=64)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--save_every", type=int, default=10000)
    p.add_argument("--mem_every", type=int, default=5)
    return p


class VOSClips(Dataset):
    def __init__(self, im_root, gt_root, args, repeat=1, subset=None):
        self.im_root, self.gt_root, self.a = im_root, gt_root, args
        self.videos = [v for v in sorted(os.listdir(im_root)) if (subset is None or v in subset)
                       and len(os.listdir(os.path.join(im_root, v))) >= args.num_frames]
        self.videos *= repeat

    def __len__(self):
        return len(self.videos)

    def __getitem__(self, idx):
        a, vid = self.a, self.videos[idx]
        names = sorted(os.listdir(os.path.join(self.im_root, vid)))
        S, T, K = a.size, a.num_frames, a.max_objects
        for _ in range(5):
            i = [random.randint(0, len(names) - T)]
            for _ in range(T - 1):
                i.append(min(len(names) - 1, i[-1] + random.randint(1, a.max_skip)))
            scale = random.uniform(1.0, 1.4)
            flip = random.random() < 0.5
            ims, gts = [], []
            for j in i:
                im = Image.open(os.path.join(self.im_root, vid, names[j])).convert("RGB")
                gt = Image.open(os.path.join(self.gt_root, vid, names[j][:-4] + ".png")).convert("P")
                w, h = im.size
                nw, nh = max(S, int(w * S / min(w, h) * scale)), max(S, int(h * S / min(w, h) * scale))
                if not ims:
                    x0, y0 = random.randint(0, nw - S), random.randint(0, nh - S)
                im = np.asarray(im.resize((nw, nh), Image.BILINEAR))[y0:y0 + S, x0:x0 + S]
                gt = np.asarray(gt.resize((nw, nh), Image.NEAREST))[y0:y0 + S, x0:x0 + S]
                ims.append(im[:, ::-1] if flip else im)
                gts.append(gt[:, ::-1] if flip else gt)
            labels = [l for l in np.unique(gts[0]) if l != 0]
            if labels:
                break
        labels = random.sample(labels, min(K, len(labels)))
        frames = (torch.from_numpy(np.stack(ims).copy()).permute(0, 3, 1, 2).float() / 255 - MEAN) / STD
        gts = np.stack(gts)
        masks = torch.zeros(T, K, S, S)
        selector = torch.zeros(K)
        for k, l in enumerate(labels):
            masks[:, k] = torch.from_numpy(gts == l).float()
            selector[k] = 1
        return frames, masks, selector


def resnet_trunk(depth, in_ch=3):
    net = (resnet50 if depth == 50 else resnet18)(
        weights=ResNet50_Weights.IMAGENET1K_V1 if depth == 50 else ResNet18_Weights.IMAGENET1K_V1,
        norm_layer=FrozenBatchNorm2d)
    if in_ch != 3:
        conv = nn.Conv2d(in_ch, 64, 7, 2, 3, bias=False)
        with torch.no_grad():
            conv.weight.zero_()
            conv.weight[:, :3] = net.conv1.weight
        net.conv1 = conv
    return nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2, net.layer3)


class HiddenUpdater(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.transform = nn.Conv2d(in_dim + hidden_dim, hidden_dim * 3, 3, padding=1)
        nn.init.xavier_normal_(self.transform.weight)

    def forward(self, x, h):
        v = self.transform(torch.cat([x, h], 1))
        d = self.hidden_dim
        forget, update, new = torch.sigmoid(v[:, :d]), torch.sigmoid(v[:, d:2 * d]), torch.tanh(v[:, 2 * d:])
        return forget * h * (1 - update) + update * new


class XMem(nn.Module):
    def __init__(self, hidden_dim=64, key_dim=64, value_dim=512):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.key_encoder = resnet_trunk(50)
        self.key_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.shrinkage_proj = nn.Conv2d(1024, 1, 3, padding=1)
        self.selection_proj = nn.Conv2d(1024, key_dim, 3, padding=1)
        self.value_encoder = resnet_trunk(18, in_ch=5)
        self.value_fuser = nn.Sequential(nn.Conv2d(1024 + 256, value_dim, 3, padding=1), nn.ReLU(inplace=True),
                                         nn.Conv2d(value_dim, value_dim, 3, padding=1))
        self.value_hidden = HiddenUpdater(value_dim, hidden_dim)
        self.decoder_fuser = nn.Sequential(nn.Conv2d(1024 + value_dim + hidden_dim, 512, 3, padding=1),
                                           nn.ReLU(inplace=True), nn.Conv2d(512, 256, 3, padding=1))
        self.decoder_hidden = HiddenUpdater(256, hidden_dim)
        self.pred = nn.Sequential(nn.ReLU(), nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 1, 3, padding=1))

    def encode_key(self, x):
        f16 = self.key_encoder(x)
        return f16, self.key_proj(f16), self.shrinkage_proj(f16) ** 2 + 1, torch.sigmoid(self.selection_proj(f16))

    def encode_value(self, image, f16, hidden, masks):
        B, K = masks.shape[:2]
        others = masks.sum(1, keepdim=True) - masks
        x = torch.cat([image.unsqueeze(1).expand(-1, K, -1, -1, -1), masks.unsqueeze(2), others.unsqueeze(2)], 2)
        g = self.value_encoder(x.flatten(0, 1))
        g = self.value_fuser(torch.cat([g, f16.unsqueeze(1).expand(-1, K, -1, -1, -1).flatten(0, 1)], 1))
        h = self.value_hidden(g, hidden.flatten(0, 1))
        return g.view(B, K, *g.shape[1:]), h.view(B, K, *h.shape[1:])

    def read_memory(self, mk, ms, mv, qk, qe):
        a_sq = mk.pow(2).transpose(1, 2) @ qe
        two_ab = 2 * (mk.transpose(1, 2) @ (qk * qe))
        b_sq = (qe * qk.pow(2)).sum(1, keepdim=True)
        aff = F.softmax((-a_sq + two_ab - b_sq) * ms.transpose(1, 2) / math.sqrt(mk.shape[1]), dim=1)
        B, K, C, _ = mv.shape
        return (mv.flatten(1, 2) @ aff).view(B, K, C, *qk.shape[-1:])

    def segment(self, f16, readout, hidden, out_size):
        B, K = readout.shape[:2]
        x = torch.cat([f16.unsqueeze(1).expand(-1, K, -1, -1, -1), readout, hidden], 2).flatten(0, 1)
        x = self.decoder_fuser(x)
        hidden = self.decoder_hidden(x, hidden.flatten(0, 1)).view(B, K, self.hidden_dim, *x.shape[-2:])
        logits = F.interpolate(self.pred(x), size=out_size, mode="bilinear", align_corners=False)
        return logits.view(B, K, *out_size), hidden

    def forward(self, frames, masks, selector):
        B, T, _, H, W = frames.shape
        K = masks.shape[2]
        f16, key, shrink, sel = (x.view(B, T, *x.shape[1:]) for x in self.encode_key(frames.flatten(0, 1)))
        h, w = f16.shape[-2:]
        hidden = torch.zeros(B, K, self.hidden_dim, h, w, device=frames.device)
        sm = selector[:, :, None, None]
        v, hidden = self.encode_value(frames[:, 0], f16[:, 0], hidden, masks[:, 0] * sm)
        mk, ms, mv, out = [key[:, 0]], [shrink[:, 0]], [v], []
        for t in range(1, T):
            readout = self.read_memory(torch.stack(mk, 2).flatten(2), torch.stack(ms, 2).flatten(2),
                                       torch.stack(mv, 3).flatten(3), key[:, t].flatten(2), sel[:, t].flatten(2))
            logits, hidden = self.segment(f16[:, t], readout.view(B, K, -1, h, w), hidden, (H, W))
            out.append(logits)
            if t < T - 1:
                prob = torch.sigmoid(logits) * sm
                v, hidden = self.encode_value(frames[:, t], f16[:, t], hidden, prob)
                mk.append(key[:, t])
                ms.append(shrink[:, t])
                mv.append(v)
        return torch.stack(out, 1)


def loss_fn(logits, gt, selector):
    sm = selector[:, None, :, None, None]
    bce = (F.binary_cross_entropy_with_logits(logits, gt, reduction="none") * sm).sum()
    bce = bce / (sm.sum() * logits.shape[1] * logits.shape[-1] * logits.shape[-2]).clamp(min=1)
    p, g = torch.sigmoid(logits).flatten(-2), gt.flatten(-2)
    dice = 1 - (2 * (p * g).sum(-1) + 1) / (p.sum(-1) + g.sum(-1) + 1)
    dice = (dice * selector[:, None]).sum() / (selector.sum() * logits.shape[1]).clamp(min=1)
    return bce + dice


def boundary_f(pred, gt, tol=3):
    def edge(m):
        m = m.float()[:, None]
        return (m + F.max_pool2d(-m, 3, 1, 1))[:, 0] > 0

    def dilate(m):
        return F.max_pool2d(m.float()[:, None], 2 * tol + 1, 1, tol)[:, 0] > 0

    pe, ge = edge(pred), edge(gt)
    prec = (pe & dilate(ge)).flatten(1).sum(1) / pe.flatten(1).sum(1).clamp(min=1)
    rec = (ge & dilate(pe)).flatten(1).sum(1) / ge.flatten(1).sum(1).clamp(min=1)
    f = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    empty = (pe.flatten(1).sum(1) == 0) & (ge.flatten(1).sum(1) == 0)
    return torch.where(empty, torch.ones_like(f), f).mean()


@torch.no_grad()
def evaluate(net, args, device, rank, world):
    root = args.davis_root
    videos = open(os.path.join(root, "ImageSets/2017/val.txt")).read().split()
    jf = torch.zeros(3, device=device)
    net.eval()
    for vid in videos[rank::world]:
        names = sorted(os.listdir(os.path.join(root, "JPEGImages/480p", vid)))
        frames = torch.stack([(torch.from_numpy(np.asarray(Image.open(os.path.join(root, "JPEGImages/480p", vid, n))
                                                           .convert("RGB"))).permute(2, 0, 1).float() / 255 - MEAN) / STD
                              for n in names]).to(device)
        gts = torch.stack([torch.from_numpy(np.asarray(Image.open(os.path.join(root, "Annotations/480p", vid, n[:-4] + ".png"))))
                           for n in names]).long().to(device)
        H, W = gts.shape[-2:]
        frames = F.pad(frames, (0, (-W) % 16, 0, (-H) % 16), mode="replicate")
        K = int(gts[0].max())
        prob = F.pad(torch.stack([(gts[0] == k + 1).float() for k in range(K)]), (0, (-W) % 16, 0, (-H) % 16))[None]
        f16, key, shrink, sel = net.encode_key(frames[:1])
        hidden = torch.zeros(1, K, net.hidden_dim, *f16.shape[-2:], device=device)
        v, hidden = net.encode_value(frames[:1], f16, hidden, prob)
        mem = [(key, shrink, v)]
        preds = [gts[0]]
        for t in range(1, len(names)):
            f16, key, shrink, sel = net.encode_key(frames[t:t + 1])
            readout = net.read_memory(torch.stack([m[0] for m in mem], 2).flatten(2), torch.stack([m[1] for m in mem], 2).flatten(2),
                                      torch.stack([m[2] for m in mem], 3).flatten(3), key.flatten(2), sel.flatten(2))
            logits, hidden = net.segment(f16, readout.view(1, K, -1, *f16.shape[-2:]), hidden, frames.shape[-2:])
            prob = torch.sigmoid(logits)
            preds.append(torch.where(prob.max(1).values > 0.5, prob.argmax(1) + 1, 0)[0, :H, :W])
            if t % args.mem_every == 0:
                v, hidden = net.encode_value(frames[t:t + 1], f16, hidden, prob)
                mem.append((key, shrink, v))
        pred = torch.stack(preds)
        for k in range(1, K + 1):
            p, g = pred[1:-1] == k, gts[1:-1] == k
            u = (p | g).flatten(1).sum(1).float()
            jf[0] += torch.where(u > 0, (p & g).flatten(1).sum(1) / u.clamp(min=1), torch.ones_like(u)).mean()
            jf[1] += boundary_f(p, g)
            jf[2] += 1
    dist.all_reduce(jf)
    net.train()
    return (jf[0] / jf[2]).item(), (jf[1] / jf[2]).item()


def save_checkpoint(model, optimizer, it, path):
    torch.save({"it": it,
                "image_encoder": model.key_encoder.state_dict(),
                "memory": {k: v for k, v in model.state_dict().items() if not k.startswith("key_encoder.")},
                "optimizer": optimizer.state_dict()}, path)


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    random.seed(42 + rank)
    save_dir = os.path.join("saves", args.exp)
    writer = None
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join("logs", args.exp))

    net = XMem(args.hidden_dim).to(device)
    if args.init:
        sd = torch.load(args.init, map_location="cpu")
        msg = net.load_state_dict(sd, strict=False)
        if rank == 0:
            print(f"loaded {args.init}: {msg}")
    model = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: min(1.0, (it + 1) / 1000) * (0.1 if it > 0.8 * args.iterations else 1.0))

    davis = VOSClips(os.path.join(args.davis_root, "JPEGImages/480p"), os.path.join(args.davis_root, "Annotations/480p"),
                     args, repeat=5, subset=set(open(os.path.join(args.davis_root, "ImageSets/2017/train.txt")).read().split()))
    yv = VOSClips(os.path.join(args.yv_root, "JPEGImages"), os.path.join(args.yv_root, "Annotations"), args)
    data = ConcatDataset([davis, yv])
    sampler = DistributedSampler(data, shuffle=True, drop_last=True)
    loader = DataLoader(data, args.batch_size, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    it, epoch, tic = 0, 0, time.time()
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for frames, masks, selector in loader:
            frames, masks, selector = frames.to(device), masks.to(device), selector.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(frames, masks, selector)
            loss = loss_fn(logits.float(), masks[:, 1:], selector)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            optimizer.step()
            scheduler.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), it)
                print(f"it {it} loss {loss.item():.4f} {(time.time() - tic) / 100:.3f}s/it", flush=True)
                tic = time.time()
            if it % args.eval_every == 0:
                j, f = evaluate(model.module, args, device, rank, world)
                if rank == 0:
                    writer.add_scalar("val/J", j, it)
                    writer.add_scalar("val/F", f, it)
                    writer.add_scalar("val/JF", (j + f) / 2, it)
            if rank == 0 and it % args.save_every == 0:
                save_checkpoint(model, optimizer, it, os.path.join(save_dir, f"{args.exp}_{it}.pth"))
            if it >= args.iterations:
                break
        epoch += 1

    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(save_dir, f"{args.exp}_final.pth"))
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
