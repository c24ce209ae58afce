#!/usr/bin/env python
# Pretrain a word recognizer on rendered synthetic text, then validate on real crops.
# The synthetic set is rendered once (fonts x lexicon x backgrounds) into an LMDB and reused.
#
#   torchrun --nnodes=1 --nproc_per_node=8 05_synth_lmdb_pretrain.py --config configs/synth_pretrain.yaml
import argparse
import io
import os
import random
import time

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image, ImageDraw, ImageFilter, ImageFont
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet34

DEFAULTS = {
    "fonts_dir": "assets/fonts",
    "bg_dir": "assets/backgrounds",
    "lexicon": "assets/lexicon_90k.txt",
    "synth_cache": "/mnt/shared/cache/synth_words_2m.lmdb",
    "n_synth": 2_000_000,
    "val_lmdb": "/mnt/shared/data/real_val.lmdb",
    "charset": "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-.,:'&!?",
    "img_h": 32, "img_w": 128, "max_len": 25,
    "batch_size": 256, "lr": 5e-4, "epochs": 6, "workers": 8,
    "out": "runs/synth_pretrain",
}


def load_cfg(path):
    cfg = dict(DEFAULTS)
    if path:
        with open(path) as f:
            cfg.update(yaml.safe_load(f) or {})
    return cfg


def render_word(word, fonts, backgrounds, h=48):
    font = ImageFont.truetype(random.choice(fonts), size=random.randint(28, 44))
    l, t, r, b = font.getbbox(word)
    w, th = r - l + 16, b - t + 12
    bg = Image.open(random.choice(backgrounds)).convert("RGB")
    x0, y0 = random.randint(0, max(0, bg.width - w)), random.randint(0, max(0, bg.height - th))
    canvas = bg.crop((x0, y0, x0 + w, y0 + th)).resize((w, th))
    draw = ImageDraw.Draw(canvas)
    color = tuple(int(c) for c in np.random.randint(0, 120, 3))
    draw.text((8 - l, 6 - t), word, font=font, fill=color)
    if random.random() < 0.3:
        canvas = canvas.rotate(random.uniform(-4, 4), expand=True, fillcolor=canvas.getpixel((0, 0)))
    if random.random() < 0.3:
        canvas = canvas.filter(ImageFilter.GaussianBlur(random.uniform(0.3, 1.2)))
    return canvas.resize((max(8, int(canvas.width * h / canvas.height)), h))


def build_synth_lmdb(path, n, cfg):
    fonts = [os.path.join(cfg["fonts_dir"], f) for f in os.listdir(cfg["fonts_dir"]) if f.endswith((".ttf", ".otf"))]
    backgrounds = [os.path.join(cfg["bg_dir"], f) for f in os.listdir(cfg["bg_dir"])]
    with open(cfg["lexicon"]) as f:
        words = [w.strip() for w in f if 0 < len(w.strip()) <= cfg["max_len"]]
    env = lmdb.open(path, map_size=1 << 40)
    txn = env.begin(write=True)
    for i in range(1, n + 1):
        word = random.choice(words)
        if random.random() < 0.2:
            word = word.upper()
        elif random.random() < 0.2:
            word = word.capitalize()
        buf = io.BytesIO()
        render_word(word, fonts, backgrounds).save(buf, format="JPEG", quality=90)
        txn.put(b"image-%09d" % i, buf.getvalue())
        txn.put(b"label-%09d" % i, word.encode())
        if i % 10000 == 0:
            txn.commit()
            txn = env.begin(write=True)
    txn.put(b"num-samples", str(n).encode())
    txn.commit()
    env.close()


class WordLmdb(Dataset):
    def __init__(self, path, cfg, train=True):
        self.path, self.cfg, self.train = path, cfg, train
        self.c2i = {c: i + 1 for i, c in enumerate(cfg["charset"])}
        env = lmdb.open(path, readonly=True, lock=False)
        with env.begin() as txn:
            self.n = int(txn.get(b"num-samples"))
        env.close()
        self.env = None

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False, max_readers=64)
        with self.env.begin() as txn:
            img = Image.open(io.BytesIO(txn.get(b"image-%09d" % (i + 1)))).convert("RGB")
            label = txn.get(b"label-%09d" % (i + 1)).decode()
        img = img.resize((self.cfg["img_w"], self.cfg["img_h"]), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        y = [self.c2i[c] for c in label if c in self.c2i][: self.cfg["max_len"]]
        return x, torch.tensor(y, dtype=torch.long), label


def collate(batch):
    xs, ys, labels = zip(*batch)
    return torch.stack(xs), torch.cat(ys), torch.tensor([len(y) for y in ys]), list(labels)


class ResNetCTC(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        r = resnet34(weights=None)
        # keep horizontal resolution: stride (2,1) in the last two stages
        r.layer3[0].conv1.stride = (2, 1)
        r.layer3[0].downsample[0].stride = (2, 1)
        r.layer4[0].conv1.stride = (2, 1)
        r.layer4[0].downsample[0].stride = (2, 1)
        r.maxpool = nn.Identity()
        self.body = nn.Sequential(r.conv1, r.bn1, r.relu, r.layer1, r.layer2, r.layer3, r.layer4)
        enc = nn.TransformerEncoderLayer(512, 8, 1024, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(enc, num_layers=2)
        self.cls = nn.Linear(512, n_classes)

    def forward(self, x):
        f = self.body(x)              # B, 512, 2, W/4
        f = f.mean(2).transpose(1, 2)  # B, T, 512
        return self.cls(self.encoder(f))


def decode(logits, charset):
    out = []
    for seq in logits.argmax(-1).tolist():
        s, prev = [], 0
        for k in seq:
            if k and k != prev:
                s.append(charset[k - 1])
            prev = k
        out.append("".join(s))
    return out


@torch.no_grad()
def word_accuracy(net, loader, device, charset):
    net.eval()
    stats = torch.zeros(2, device=device)
    for x, _, _, labels in loader:
        preds = decode(net(x.to(device)).cpu(), charset)
        stats[0] += sum(p.lower() == l.lower() for p, l in zip(preds, labels))
        stats[1] += len(labels)
    dist.all_reduce(stats)
    net.train()
    return (stats[0] / stats[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="")
    cfg = load_cfg(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    np.random.seed(rank)

    if not os.path.exists(cfg["synth_cache"]):
        t0 = time.time()
        build_synth_lmdb(cfg["synth_cache"], cfg["n_synth"], cfg)
        print(f"[rank {rank}] rendered {cfg['n_synth']} words in {time.time() - t0:.0f}s", flush=True)

    train_ds = WordLmdb(cfg["synth_cache"], cfg)
    val_ds = WordLmdb(cfg["val_lmdb"], cfg, train=False)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                              collate_fn=collate, pin_memory=True, drop_last=True)
    val_subset = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
    val_loader = DataLoader(val_subset, 512, num_workers=4, collate_fn=collate)

    charset = cfg["charset"]
    model = DDP(ResNetCTC(len(charset) + 1).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["epochs"] * len(train_loader),
                                                pct_start=0.05)
    ctc = nn.CTCLoss(zero_infinity=True)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(cfg["out"], exist_ok=True)
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for step, (x, y, ylen, _) in enumerate(train_loader):
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            lp = F.log_softmax(logits.float(), -1).transpose(0, 1)
            loss = ctc(lp, y, torch.full((x.size(0),), lp.size(0), dtype=torch.long), ylen)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 20.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} loss {loss.item():.3f}", flush=True)

        acc = word_accuracy(model.module, val_loader, device, charset)
        if rank == 0:
            print(f"epoch {epoch}: real-val word acc {acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "charset": charset},
                       os.path.join(cfg["out"], f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
