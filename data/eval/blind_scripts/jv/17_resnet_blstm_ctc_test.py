"""ResNet-BLSTM CTC line recognizer (IAM, RWTH split), with a final test-set evaluation of the
best validation checkpoint and optional lexicon-free beam search via pyctcdecode.

    torchrun --nproc_per_node=4 17_resnet_blstm_ctc_test.py --data data/iam_rwth --out runs/resblstm
"""
import argparse
import json
import math
import os
import time

import editdistance
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="folder with {train,val,test}.jsonl, charset.txt, img/")
    p.add_argument("--out", default="runs/resblstm")
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=12, help="per GPU")
    p.add_argument("--base-lr", type=float, default=2e-4, help="per 16 lines")
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--beam", type=int, default=0, help="beam width for the final test decode (0 = greedy)")
    return p.parse_args()


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l) for l in f if l.strip()]


class Lines(Dataset):
    def __init__(self, rows, img_dir, charset, height, train=False):
        self.rows, self.img_dir, self.height, self.train = rows, img_dir, height, train
        self.c2i = {c: i + 1 for i, c in enumerate(charset)}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        im = Image.open(os.path.join(self.img_dir, r["file"])).convert("L")
        w = max(self.height, round(im.width * self.height / im.height))
        if self.train:
            w = int(w * np.random.uniform(0.9, 1.1))
        im = im.resize((w, self.height), Image.BILINEAR)
        x = torch.from_numpy(1.0 - np.asarray(im, dtype=np.float32) / 255.0)[None]
        y = torch.tensor([self.c2i[c] for c in r["text"] if c in self.c2i], dtype=torch.long)
        return x, y, r["text"]


def collate(batch):
    xs, ys, texts = zip(*batch)
    W = int(math.ceil(max(x.shape[-1] for x in xs) / 16) * 16)
    x = torch.zeros(len(xs), 1, xs[0].shape[1], W)
    for i, t in enumerate(xs):
        x[i, ..., : t.shape[-1]] = t
    return x, torch.tensor([t.shape[-1] for t in xs]), torch.cat(ys), torch.tensor([len(y) for y in ys]), list(texts)


class HTRNet(nn.Module):
    def __init__(self, n_classes):
        super().__init__()
        r = torchvision.models.resnet18(weights=None)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        r.layer3[0].conv1.stride = (2, 1)
        r.layer3[0].downsample[0].stride = (2, 1)
        r.layer4[0].conv1.stride = (2, 1)
        r.layer4[0].downsample[0].stride = (2, 1)
        self.cnn = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3, r.layer4)
        self.rnn = nn.LSTM(512, 256, num_layers=2, bidirectional=True, dropout=0.3)
        self.fc = nn.Linear(512, n_classes)

    def forward(self, x):
        f = self.cnn(x).amax(dim=2)          # B, 512, W/8
        f, _ = self.rnn(f.permute(2, 0, 1))  # T, B, 512
        return self.fc(f)


def greedy(logits, lens, charset):
    res = []
    for b, seq in enumerate(logits.argmax(-1).t().tolist()):
        s, prev = [], 0
        for k in seq[: lens[b]]:
            if k and k != prev:
                s.append(charset[k - 1])
            prev = k
        res.append("".join(s))
    return res


@torch.no_grad()
def run_eval(net, loader, charset, device, decoder=None):
    net.eval()
    cer_e = cer_n = wer_e = wer_n = 0
    for x, widths, _, _, texts in loader:
        logits = net(x.to(device))
        lens = (widths // 8).clamp(max=logits.shape[0]).tolist()
        if decoder is None:
            preds = greedy(logits, lens, charset)
        else:
            lp = logits.log_softmax(-1).transpose(0, 1).cpu().numpy()
            preds = [decoder.decode(lp[b, : lens[b]]) for b in range(lp.shape[0])]
        for p, g in zip(preds, texts):
            cer_e += editdistance.eval(p, g)
            cer_n += len(g)
            wer_e += editdistance.eval(p.split(), g.split())
            wer_n += len(g.split())
    net.train()
    return torch.tensor([cer_e, cer_n, wer_e, wer_n], dtype=torch.float64, device=device)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(5)
    np.random.seed(5 + rank)

    with open(os.path.join(args.data, "charset.txt"), encoding="utf-8") as f:
        charset = list(f.read().rstrip("\n"))
    img_dir = os.path.join(args.data, "img")
    train = Lines(read_jsonl(os.path.join(args.data, "train.jsonl")), img_dir, charset, args.height, train=True)
    val = Lines(read_jsonl(os.path.join(args.data, "val.jsonl")), img_dir, charset, args.height)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                              collate_fn=collate, pin_memory=True, drop_last=True,
                              worker_init_fn=lambda w: np.random.seed(torch.initial_seed() % 2**32))
    val_loader = DataLoader(Subset(val, range(rank, len(val), world)), batch_size=24,
                            num_workers=args.workers, collate_fn=collate)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(HTRNet(len(charset) + 1)).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.base_lr * args.batch_size * world / 16
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_loader),
                                                pct_start=0.05)
    ctc = nn.CTCLoss(zero_infinity=True)
    tb = SummaryWriter(args.out) if rank == 0 else None
    best_path = os.path.join(args.out, "best.pt")
    best = float("inf")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, widths, y, ylen, _) in enumerate(train_loader):
            logits = model(x.to(device, non_blocking=True))
            lp = logits.log_softmax(-1)
            xlen = (widths // 8).clamp(max=lp.shape[0]).to(device)
            loss = ctc(lp, y.to(device), xlen, ylen.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if tb is not None and it % 100 == 0:
                tb.add_scalar("train/loss", loss.item(), epoch * len(train_loader) + it)

        stats = run_eval(model.module, val_loader, charset, device)
        dist.all_reduce(stats)
        cer, wer = (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()
        if rank == 0:
            tb.add_scalar("val/cer", cer, epoch)
            tb.add_scalar("val/wer", wer, epoch)
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val CER {cer:.4f} WER {wer:.4f}", flush=True)
            if cer < best:
                best = cer
                torch.save({"model": model.state_dict(), "charset": charset, "epoch": epoch, "cer": cer}, best_path)
        dist.barrier()

    # final test of the best checkpoint, on rank 0 only
    if rank == 0:
        test = Lines(read_jsonl(os.path.join(args.data, "test.jsonl")), img_dir, charset, args.height)
        test_loader = DataLoader(test, batch_size=24, num_workers=args.workers, collate_fn=collate)
        ck = torch.load(best_path, map_location=device)
        net = HTRNet(len(charset) + 1).to(device)
        net.load_state_dict(ck["model"])
        decoder = None
        if args.beam > 0:
            from pyctcdecode import build_ctcdecoder
            decoder = build_ctcdecoder([""] + charset)
        s = run_eval(net, test_loader, charset, device, decoder)
        print(f"TEST (epoch {ck['epoch']}): CER {(s[0] / s[1]).item():.4f} WER {(s[2] / s[3]).item():.4f}", flush=True)
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
