"""Image-to-LaTeX: ResNet encoder + Transformer decoder, with an EMA copy of the weights used
for validation (greedy decoding, BLEU + exact match on the full validation set).

    torchrun --nproc_per_node=8 15_latex_ocr_resnet_decoder.py --data data/im2latex-170k --ema 0.999
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.text import BLEUScore
import torchvision.transforms.functional as TF


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/im2latex-170k")
    p.add_argument("--ckpt_dir", default="ckpts/resnet_dec")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--max_len", type=int, default=200)
    p.add_argument("--dim", type=int, default=256)
    return p.parse_args()


class Im2Tex(Dataset):
    def __init__(self, root, split, vocab, height, max_len):
        self.rows = []
        with open(os.path.join(root, f"{split}.tsv"), encoding="utf-8") as f:
            for line in f:
                img, tex = line.rstrip("\n").split("\t")
                t = tex.split()
                if len(t) <= max_len - 2:
                    self.rows.append((img, t))
        self.root, self.vocab, self.height = root, vocab, height

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        img, toks = self.rows[i]
        im = Image.open(os.path.join(self.root, "images", img)).convert("L")
        im = im.resize((max(16, im.width * self.height // im.height), self.height), Image.BILINEAR)
        return TF.to_tensor(im), torch.tensor([1] + [self.vocab.get(t, 3) for t in toks] + [2])


def collate(batch):
    xs, ys = zip(*batch)
    W = max(x.shape[-1] for x in xs)
    img = torch.ones(len(xs), 1, xs[0].shape[1], W)
    for i, x in enumerate(xs):
        img[i, ..., : x.shape[-1]] = x
    return img, nn.utils.rnn.pad_sequence(ys, batch_first=True)


class ResNetTex(nn.Module):
    def __init__(self, vocab, dim, max_len):
        super().__init__()
        r = torchvision.models.resnet34(weights=None)
        r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        r.maxpool = nn.Identity()
        self.enc = nn.Sequential(r.conv1, r.bn1, r.relu, r.layer1, r.layer2, r.layer3)   # stride 8
        self.enc_proj = nn.Conv2d(256, dim, 1)
        self.row = nn.Parameter(torch.randn(1, dim, 16, 1) * 0.02)
        self.col = nn.Parameter(torch.randn(1, dim, 1, 512) * 0.02)
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, max_len, dim) * 0.02)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 1024, 0.1, batch_first=True), 3)
        self.head = nn.Linear(dim, vocab)

    def encode(self, x):
        f = self.enc_proj(self.enc(x))
        H, W = f.shape[2:]
        return (f + self.row[:, :, :H] + self.col[:, :, :, :W]).flatten(2).transpose(1, 2)

    def decode(self, mem, y):
        L = y.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=y.device)
        return self.head(self.dec(self.emb(y) + self.pos[:, :L], mem, tgt_mask=causal))

    def forward(self, x, y):
        return self.decode(self.encode(x), y)

    @torch.no_grad()
    def greedy(self, x, max_len):
        mem = self.encode(x)
        y = torch.ones(x.shape[0], 1, dtype=torch.long, device=x.device)
        done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        for _ in range(max_len - 1):
            nxt = self.decode(mem, y)[:, -1].argmax(-1).masked_fill(done, 0)
            y = torch.cat([y, nxt[:, None]], 1)
            done |= nxt == 2
            if done.all():
                break
        return y


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


def ids_to_str(ids, itos):
    out = []
    for i in ids[1:]:
        if i == 2:
            break
        if i > 3:
            out.append(itos[i])
    return " ".join(out)


@torch.no_grad()
def validate(ema, loader, itos, max_len, device):
    ema.eval()
    world = dist.get_world_size()
    preds, refs = [], []
    for x, y in loader:
        pred = ema.greedy(x.to(device), max_len)
        y = y.to(device)
        all_pred = [torch.zeros_like(pred) for _ in range(world)]
        all_ref = [torch.zeros_like(y) for _ in range(world)]
        dist.all_gather(all_pred, pred)
        dist.all_gather(all_ref, y)
        for p, r in zip(torch.cat(all_pred).tolist(), torch.cat(all_ref).tolist()):
            preds.append(ids_to_str(p, itos))
            refs.append(ids_to_str(r, itos))
    bleu = BLEUScore(n_gram=4)(preds, [[r] for r in refs]).item()
    em = sum(p == r for p, r in zip(preds, refs)) / len(refs)
    return bleu, em


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    itos = ["<pad>", "<s>", "</s>", "<unk>"] + open(os.path.join(args.data, "vocab.txt")).read().split()
    vocab = {t: i for i, t in enumerate(itos)}
    tr = Im2Tex(args.data, "train", vocab, args.height, args.max_len)
    va = Im2Tex(args.data, "val", vocab, args.height, args.max_len)
    tr_s = DistributedSampler(tr, shuffle=True)
    tr_dl = DataLoader(tr, args.batch, sampler=tr_s, collate_fn=collate, num_workers=8, pin_memory=True,
                       drop_last=True)
    va_dl = DataLoader(va, args.batch, sampler=DistributedSampler(va, shuffle=False), collate_fn=collate,
                       num_workers=4, pin_memory=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(ResNetTex(len(itos), args.dim, args.max_len)).to(device)
    ema = copy.deepcopy(net).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, epochs=args.epochs, steps_per_epoch=len(tr_dl),
                                                pct_start=0.03)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    best = -1.0
    for epoch in range(args.epochs):
        tr_s.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(tr_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x, y[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), y[:, 1:], ignore_index=0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ema_update(ema, model.module, args.ema)
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}/{step}] loss {loss.item():.4f}", flush=True)

        bleu, em = validate(ema, va_dl, itos, args.max_len, device)
        if rank == 0:
            print(f"epoch {epoch}: EMA BLEU {bleu:.4f} exact {em:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, os.path.join(args.ckpt_dir, "last.pt"))
            if bleu > best:
                best = bleu
                torch.save(ema.state_dict(), os.path.join(args.ckpt_dir, "best_ema.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
