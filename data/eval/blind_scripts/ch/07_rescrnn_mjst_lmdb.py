"""Scene-text recognition: ResNet-CRNN + CTC trained on MJ+ST LMDBs, evaluated on IIIT5K/SVT/IC13.

Launch:
    torchrun --nproc_per_node=8 07_rescrnn_mjst_lmdb.py \
        --train /data/str/train/MJ /data/str/train/ST --val /data/str/eval/IIIT5k_3000 /data/str/eval/SVT
"""
import argparse
import io
import os
import re
import time

import lmdb
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


class LmdbText(Dataset):
    def __init__(self, root, img_h=32, img_w=128, max_len=25):
        self.root = root
        self.img_h, self.img_w, self.max_len = img_h, img_w, max_len
        env = lmdb.open(root, readonly=True, lock=False, readahead=False, meminit=False)
        with env.begin() as txn:
            n = int(txn.get(b"num-samples"))
            self.labels = []
            self.keys = []
            for i in range(1, n + 1):
                lab = txn.get(b"label-%09d" % i).decode("utf-8")
                if 0 < len(lab) <= max_len:
                    self.labels.append(lab)
                    self.keys.append(i)
        env.close()
        self.env = None

    def __len__(self):
        return len(self.keys)

    def _open(self):
        self.env = lmdb.open(self.root, readonly=True, lock=False, readahead=False, meminit=False)

    def __getitem__(self, idx):
        if self.env is None:
            self._open()
        with self.env.begin() as txn:
            buf = txn.get(b"image-%09d" % self.keys[idx])
        img = Image.open(io.BytesIO(buf)).convert("RGB").resize((self.img_w, self.img_h), Image.BICUBIC)
        x = torch.from_numpy(np.asarray(img, np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        return x, self.labels[idx]


def build_charset(datasets, max_chars=None):
    chars = set()
    for ds in datasets:
        for lab in ds.labels:
            chars.update(lab)
    charset = list(chars)
    return charset[:max_chars] if max_chars else charset


class CTCCodec:
    def __init__(self, charset):
        self.charset = charset
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}

    @property
    def num_classes(self):
        return len(self.charset) + 1

    def encode(self, texts):
        ids = [[self.c2i[c] for c in t if c in self.c2i] for t in texts]
        lengths = torch.tensor([len(t) for t in ids], dtype=torch.long)
        flat = torch.tensor([i for t in ids for i in t], dtype=torch.long)
        return flat, lengths

    def decode(self, argmax):
        texts = []
        for row in argmax.tolist():
            s, prev = [], 0
            for i in row:
                if i and i != prev:
                    s.append(self.charset[i - 1])
                prev = i
            texts.append("".join(s))
        return texts


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + idt)


class ResCRNN(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True))
        cfg = [(64, 64, (2, 2)), (64, 128, (2, 2)), (128, 256, (2, 1)), (256, 512, (2, 1)), (512, 512, (2, 1))]
        self.body = nn.Sequential(*[nn.Sequential(BasicBlock(a, b, s), BasicBlock(b, b, 1)) for a, b, s in cfg])
        self.rnn = nn.LSTM(512, 256, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x):
        f = self.body(self.stem(x))  # B, 512, 1, W/4
        f = f.squeeze(2).transpose(1, 2)
        f, _ = self.rnn(f)
        return self.head(f)


def normalize_eval(s):
    return re.sub(r"[^0-9a-z]", "", s.lower())


@torch.no_grad()
def evaluate(model, loader, codec, device):
    model.eval()
    res = torch.zeros(2, device=device)
    for x, labels in loader:
        logits = model(x.to(device, non_blocking=True))
        preds = codec.decode(logits.argmax(-1).cpu())
        res[0] += sum(normalize_eval(p) == normalize_eval(g) for p, g in zip(preds, labels))
        res[1] += len(labels)
    dist.all_reduce(res)
    model.train()
    return (res[0] / res[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--val", nargs="+", required=True)
    ap.add_argument("--config", default=None, help="optional yaml overriding the defaults below")
    ap.add_argument("--out", default="output/rescrnn")
    ap.add_argument("--batch", type=int, default=192)
    ap.add_argument("--iters", type=int, default=300000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-every", type=int, default=5000)
    args = ap.parse_args()
    if args.config:
        with open(args.config) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(args, k, v)

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    train_sets = [LmdbText(r) for r in args.train]
    val_sets = [LmdbText(r) for r in args.val]
    charset = build_charset(train_sets)
    codec = CTCCodec(charset)
    if rank == 0:
        print(f"charset size {len(charset)}, train samples {sum(len(d) for d in train_sets)}", flush=True)

    train_ds = ConcatDataset(train_sets)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dls = {}
    for root, vs in zip(args.val, val_sets):
        shard = Subset(vs, range(rank, len(vs), world))
        val_dls[os.path.basename(root)] = DataLoader(shard, batch_size=256, num_workers=4)

    model = ResCRNN(codec.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    ctc = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.iters, pct_start=0.05)

    os.makedirs(args.out, exist_ok=True)
    it, epoch, best = 0, 0, 0.0
    tic = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for x, labels in train_dl:
            targets, target_lens = codec.encode(labels)
            x = x.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)
            input_lens = torch.full((x.shape[0],), log_probs.shape[0], dtype=torch.long)
            loss = ctc(log_probs, targets, input_lens, target_lens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            it += 1
            if rank == 0 and it % 200 == 0:
                print(f"it {it} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - tic) / it:.3f}s/it", flush=True)
            if it % args.val_every == 0 or it == args.iters:
                accs = {name: evaluate(model, dl, codec, device) for name, dl in val_dls.items()}
                avg = sum(accs.values()) / len(accs)
                if rank == 0:
                    print(f"it {it} " + " ".join(f"{k}={v:.4f}" for k, v in accs.items()) + f" avg={avg:.4f}",
                          flush=True)
                    state = {"model": model.module.state_dict(), "charset": codec.charset, "iter": it}
                    torch.save(state, os.path.join(args.out, "last.pth"))
                    if avg > best:
                        best = avg
                        torch.save(state, os.path.join(args.out, "best.pth"))
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
