"""Printed formula recognition: timm ResNet-34 features + Transformer decoder.
Step-based schedule, periodic checkpoints, restartable with --resume.

    torchrun --nproc_per_node=8 08_printed_formula_cnn_transformer.py --train_list data/train.lst \
        --val_list data/val.lst --resume checkpoints/step_040000.pt
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import torchvision.transforms as T


def arguments():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--val_list", required=True)
    ap.add_argument("--vocab", default="data/vocab.txt")
    ap.add_argument("--image_dir", default="data/images")
    ap.add_argument("--ckpt_dir", default="checkpoints")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--max_steps", type=int, default=120_000)
    ap.add_argument("--save_every", type=int, default=5_000)
    ap.add_argument("--eval_every", type=int, default=5_000)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--height", type=int, default=96)
    ap.add_argument("--max_len", type=int, default=200)
    return ap.parse_args()


class Vocab:
    def __init__(self, path):
        self.itos = ["<pad>", "<s>", "</s>", "<unk>"] + open(path, encoding="utf-8").read().split()
        self.stoi = {s: i for i, s in enumerate(self.itos)}

    def encode(self, toks):
        return [1] + [self.stoi.get(t, 3) for t in toks] + [2]

    def clean(self, ids):
        r = []
        for i in ids[1:]:
            if i == 2:
                break
            r.append(i)
        return r


class LstDataset(Dataset):
    """Each line: <image file> <tab> <space separated latex tokens>"""

    def __init__(self, lst, image_dir, vocab, height, max_len):
        self.rows = []
        for line in open(lst, encoding="utf-8"):
            f, tex = line.rstrip("\n").split("\t")
            toks = tex.split()
            if len(toks) + 2 <= max_len:
                self.rows.append((f, toks))
        self.image_dir, self.vocab, self.height = image_dir, vocab, height
        self.tf = T.Compose([T.ToTensor(), T.Normalize((0.5,), (0.5,))])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        f, toks = self.rows[i]
        im = Image.open(os.path.join(self.image_dir, f)).convert("L")
        im = im.resize((max(32, round(im.width * self.height / im.height)), self.height), Image.BICUBIC)
        return self.tf(im), torch.tensor(self.vocab.encode(toks))


def collate(batch):
    xs, ys = zip(*batch)
    W = max(x.size(2) for x in xs)
    imgs = torch.full((len(xs), 1, xs[0].size(1), W), 1.0)
    for i, x in enumerate(xs):
        imgs[i, :, :, : x.size(2)] = x
    return imgs, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class FormulaTransformer(nn.Module):
    def __init__(self, vocab_size, d=512, layers=6, max_len=200):
        super().__init__()
        self.backbone = timm.create_model("resnet34", pretrained=False, in_chans=1, features_only=True,
                                          out_indices=(3,))
        self.proj = nn.Linear(self.backbone.feature_info.channels()[-1], d)
        self.enc_pos = nn.Parameter(torch.zeros(1, 2048, d))
        self.emb = nn.Embedding(vocab_size, d, padding_idx=0)
        self.dec_pos = nn.Parameter(torch.zeros(1, max_len, d))
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, 8, 2048, 0.1, batch_first=True), layers)
        self.fc = nn.Linear(d, vocab_size)
        nn.init.normal_(self.enc_pos, std=0.02)
        nn.init.normal_(self.dec_pos, std=0.02)

    def memory(self, img):
        f = self.backbone(img)[-1]                      # B, C, H/16, W/16
        f = f.flatten(2).transpose(1, 2)
        return self.proj(f) + self.enc_pos[:, : f.shape[1]]

    def forward(self, img, ys):
        mem = self.memory(img)
        L = ys.size(1)
        causal = torch.triu(torch.ones(L, L, device=ys.device, dtype=torch.bool), 1)
        x = self.emb(ys) + self.dec_pos[:, :L]
        return self.fc(self.dec(x, mem, tgt_mask=causal, tgt_key_padding_mask=ys.eq(0)))

    @torch.no_grad()
    def greedy(self, img, max_len):
        mem = self.memory(img)
        ys = torch.ones(img.size(0), 1, dtype=torch.long, device=img.device)
        for _ in range(max_len - 1):
            L = ys.size(1)
            causal = torch.triu(torch.ones(L, L, device=ys.device, dtype=torch.bool), 1)
            h = self.dec(self.emb(ys) + self.dec_pos[:, :L], mem, tgt_mask=causal)
            ys = torch.cat([ys, self.fc(h[:, -1]).argmax(-1, keepdim=True)], 1)
            if (ys == 2).any(1).all():
                break
        return ys


def lr_at(step, base, warmup, total):
    if step < warmup:
        return base * step / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def infinite(loader, sampler, start_epoch):
    epoch = start_epoch
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


@torch.no_grad()
def exact_match(model, loader, vocab, device, max_len):
    model.eval()
    hit = torch.zeros((), device=device)
    cnt = torch.zeros((), device=device)
    for img, ys in loader:
        pred = model.module.greedy(img.to(device), max_len)
        for p, t in zip(pred.tolist(), ys.tolist()):
            hit += vocab.clean(p) == vocab.clean(t)
            cnt += 1
    dist.all_reduce(hit)
    dist.all_reduce(cnt)
    model.train()
    return (hit / cnt).item()


def main():
    args = arguments()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    vocab = Vocab(args.vocab)
    train_ds = LstDataset(args.train_list, args.image_dir, vocab, args.height, args.max_len)
    val_ds = LstDataset(args.val_list, args.image_dir, vocab, args.height, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, args.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=4)

    net = FormulaTransformer(len(vocab.itos), max_len=args.max_len)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scaler = torch.cuda.amp.GradScaler()

    step, epoch0 = 0, 0
    if args.resume:
        state = torch.load(args.resume)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        step, epoch0 = state["step"], state["epoch"]
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}", flush=True)

    os.makedirs(args.ckpt_dir, exist_ok=True)
    model.train()
    t0 = time.time()
    for epoch, (img, ys) in infinite(train_dl, sampler, epoch0):
        if step >= args.max_steps:
            break
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, args.lr, args.warmup, args.max_steps)
        img, ys = img.to(device, non_blocking=True), ys.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(img, ys[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ys[:, 1:].reshape(-1), ignore_index=0,
                                   label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        step += 1

        if rank == 0 and step % 100 == 0:
            print(f"step {step} epoch {epoch} loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"{(time.time() - t0) / 100:.3f}s/it", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0:
            em = exact_match(model, val_dl, vocab, device, args.max_len)
            if rank == 0:
                print(f"step {step}: val exact match {em:.4f}", flush=True)
        if step % args.save_every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scaler": scaler.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.ckpt_dir, f"step_{step:06d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
