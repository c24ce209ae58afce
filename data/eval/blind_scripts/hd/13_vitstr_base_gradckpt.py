"""ViTSTR-Base scene text recognizer, 224x224 input, activation checkpointing to fit batch 256/GPU.

    torchrun --nproc_per_node=8 13_vitstr_base_gradckpt.py \
        --train-root /data/str/lmdb/train --val-root /data/str/lmdb/val --grad-ckpt
"""
import argparse
import io
import os
import time

import lmdb
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.models.vision_transformer import Block, PatchEmbed
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

CHARSET = "0123456789abcdefghijklmnopqrstuvwxyz"
GO, EOS = 0, 1  # ViTSTR: [GO] token slot 0, [s] end token slot 1, chars from 2


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--train-root", required=True)
    p.add_argument("--val-root", required=True)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--iters", type=int, default=300000)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--max-len", type=int, default=25)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--count-loss", type=float, default=0.0, help="weight of the auxiliary length head")
    p.add_argument("--val-every", type=int, default=2000)
    p.add_argument("--out", default="runs/vitstr_base")
    return p.parse_args()


class LmdbSTR(Dataset):
    def __init__(self, root, max_len):
        self.root, self.max_len = root, max_len
        with lmdb.open(root, readonly=True, lock=False).begin() as txn:
            self.n = int(txn.get(b"num-samples"))
        self.env = None
        self.tf = transforms.Compose([transforms.Resize((224, 224), transforms.InterpolationMode.BICUBIC),
                                      transforms.Grayscale(), transforms.ToTensor(),
                                      transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False, max_readers=32)
        with self.env.begin() as txn:
            lab = txn.get(b"label-%09d" % (i + 1)).decode().lower()
            img = Image.open(io.BytesIO(txn.get(b"image-%09d" % (i + 1))))
        lab = "".join(c for c in lab if c in CHARSET)[: self.max_len]
        return self.tf(img.convert("RGB")), lab


def encode(labels, max_len):
    # [GO] c1 c2 ... [s] [GO]... -> length max_len + 2
    t = torch.full((len(labels), max_len + 2), GO, dtype=torch.long)
    for i, s in enumerate(labels):
        ids = [CHARSET.index(c) + 2 for c in s] + [EOS]
        t[i, 1:1 + len(ids)] = torch.tensor(ids)
    return t


def decode(idx):
    out = []
    for row in idx.tolist():
        s = []
        for k in row[1:]:
            if k == EOS:
                break
            if k >= 2:
                s.append(CHARSET[k - 2])
        out.append("".join(s))
    return out


class ViTSTR(nn.Module):
    def __init__(self, n_cls, max_len, dim=768, depth=12, heads=12, grad_ckpt=False):
        super().__init__()
        self.patch_embed = PatchEmbed(224, 16, 1, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, 4.0, qkv_bias=True, drop_path=0.1 * i / depth)
                                     for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_cls)
        self.len_head = nn.Linear(dim, max_len + 1)
        self.seq_len = max_len + 2
        self.grad_ckpt = grad_ckpt
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], 1) + self.pos_embed
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        x = self.norm(x)
        return self.head(x[:, : self.seq_len]), self.len_head(x[:, 0])


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for img, labels in loader:
        logits, _ = model(img.to(device))
        preds = decode(logits.argmax(-1).cpu())
        c[0] += sum(p == l for p, l in zip(preds, labels))
        c[1] += len(labels)
    dist.all_reduce(c)
    model.train()
    return (c[0] / c[1]).item()


def main():
    opt = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    roots = [os.path.join(opt.train_root, d) for d in sorted(os.listdir(opt.train_root))]
    train_ds = ConcatDataset([LmdbSTR(r, opt.max_len) for r in roots])
    val_ds = LmdbSTR(opt.val_root, opt.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, opt.batch_size, sampler=sampler, num_workers=12, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)), 512, num_workers=4)

    net = ViTSTR(len(CHARSET) + 2, opt.max_len, grad_ckpt=opt.grad_ckpt).to(dev)
    # the length head gets no gradient when --count-loss is 0
    net = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    optimizer = torch.optim.Adadelta(net.parameters(), lr=opt.lr, rho=0.95, eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=opt.iters)

    if rank == 0:
        os.makedirs(opt.out, exist_ok=True)
    it, epoch, best, t0 = 0, 0, 0.0, time.time()
    while it < opt.iters:
        sampler.set_epoch(epoch)
        for img, labels in loader:
            img = img.to(dev, non_blocking=True)
            tgt = encode(labels, opt.max_len).to(dev)
            logits, len_logits = net(img)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
            if opt.count_loss > 0:
                lens = torch.tensor([len(l) for l in labels], device=dev)
                loss = loss + opt.count_loss * F.cross_entropy(len_logits, lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            optimizer.step()
            sched.step()
            it += 1
            if rank == 0 and it % 100 == 0:
                print(f"it {it} loss {loss.item():.4f} {(time.time() - t0) / it:.3f}s/it", flush=True)
            if it % opt.val_every == 0:
                acc = validate(net.module, val_loader, dev)
                if rank == 0:
                    print(f"it {it} val acc {acc:.4f}", flush=True)
                    torch.save(net.module.state_dict(), os.path.join(opt.out, "last.pth"))
                    if acc > best:
                        best = acc
                        torch.save(net.module.state_dict(), os.path.join(opt.out, "best.pth"))
            if it >= opt.iters:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
