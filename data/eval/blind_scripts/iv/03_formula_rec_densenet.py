"""DenseNet encoder + Transformer decoder for printed formula recognition.

Config comes from a YAML file; command-line flags override it.

    torchrun --standalone --nproc_per_node=8 03_formula_rec_densenet.py --config configs/densenet_tf.yaml
"""
import argparse
import logging
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.models import densenet121

log = logging.getLogger("formula_rec")


@dataclass
class Config:
    data_root: str = "data/printed_formulas"
    out: str = "outputs/densenet_tf"
    epochs: int = 40
    batch_size: int = 32
    lr: float = 2e-4
    warmup_steps: int = 2000
    d_model: int = 256
    dec_layers: int = 3
    max_len: int = 200
    img_h: int = 128
    workers: int = 8
    log_every: int = 50
    bf16: bool = True
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--batch_size", type=int)
    ap.add_argument("--lr", type=float)
    ns = ap.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    for k in ("epochs", "batch_size", "lr"):
        if getattr(ns, k) is not None:
            setattr(cfg, k, getattr(ns, k))
    return cfg


class Tokenizer:
    def __init__(self, vocab_file):
        with open(vocab_file, encoding="utf-8") as f:
            toks = [l.rstrip("\n") for l in f if l.strip()]
        self.itos = ["<pad>", "<bos>", "<eos>", "<unk>"] + toks
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.pad, self.bos, self.eos, self.unk = 0, 1, 2, 3

    def __call__(self, latex, max_len):
        ids = [self.stoi.get(t, self.unk) for t in latex.split()]
        return [self.bos] + ids[: max_len - 2] + [self.eos]

    def strip(self, ids):
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i != self.bos and i != self.pad:
                out.append(i)
        return out


class FormulaDataset(Dataset):
    def __init__(self, root, split, tok, img_h, max_len):
        self.items = []
        with open(os.path.join(root, f"{split}.tsv"), encoding="utf-8") as f:
            for line in f:
                path, latex = line.rstrip("\n").split("\t", 1)
                self.items.append((os.path.join(root, path), latex))
        self.tok, self.img_h, self.max_len = tok, img_h, max_len
        self.to_tensor = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, latex = self.items[i]
        img = Image.open(path).convert("L")
        w = max(32, round(img.width * self.img_h / img.height))
        w = (w + 31) // 32 * 32
        img = img.resize((w, self.img_h), Image.LANCZOS)
        return self.to_tensor(img), torch.tensor(self.tok(latex, self.max_len))


def collate(batch):
    imgs, seqs = zip(*batch)
    W = max(x.shape[-1] for x in imgs)
    x = imgs[0].new_full((len(imgs), 1, imgs[0].shape[1], W), 1.0)   # normalised white
    for i, im in enumerate(imgs):
        x[i, ..., : im.shape[-1]] = im
    return x, nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)


class DenseEncoder(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        feats = densenet121(weights=None).features
        feats.conv0 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        # keep up to denseblock3 -> stride 16
        self.body = nn.Sequential(*list(feats.children())[:9])
        self.proj = nn.Conv2d(1024, d_model, 1)

    def forward(self, x):
        f = self.proj(self.body(x))
        B, C, H, W = f.shape
        pos = self.sine_pos(H, W, C, f.device, f.dtype)
        return (f + pos).flatten(2).transpose(1, 2)

    @staticmethod
    def sine_pos(H, W, C, device, dtype):
        c = C // 4
        omega = 1.0 / (10000 ** (torch.arange(c, device=device, dtype=torch.float32) / c))
        y = torch.arange(H, device=device, dtype=torch.float32)[:, None] * omega
        x = torch.arange(W, device=device, dtype=torch.float32)[:, None] * omega
        py = torch.cat([y.sin(), y.cos()], 1)[:, None, :].expand(H, W, 2 * c)
        px = torch.cat([x.sin(), x.cos()], 1)[None, :, :].expand(H, W, 2 * c)
        return torch.cat([py, px], -1).permute(2, 0, 1).unsqueeze(0).to(dtype)


class FormulaModel(nn.Module):
    def __init__(self, vocab_size, d_model, layers, max_len):
        super().__init__()
        self.enc = DenseEncoder(d_model)
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.dec = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d_model, 8, 1024, 0.1, batch_first=True, norm_first=True), layers)
        self.head = nn.Linear(d_model, vocab_size)

    def _dec(self, mem, ys):
        L = ys.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=ys.device)
        h = self.tok(ys) + self.pos(torch.arange(L, device=ys.device))
        return self.head(self.dec(h, mem, tgt_mask=causal, tgt_is_causal=True))

    def forward(self, img, ys):
        return self._dec(self.enc(img), ys)

    @torch.no_grad()
    def generate(self, img, bos, eos, max_len):
        mem = self.enc(img)
        ys = torch.full((img.shape[0], 1), bos, device=img.device, dtype=torch.long)
        finished = torch.zeros(img.shape[0], dtype=torch.bool, device=img.device)
        for _ in range(max_len - 1):
            nxt = self._dec(mem, ys)[:, -1].argmax(-1)
            nxt = nxt.masked_fill(finished, eos)
            ys = torch.cat([ys, nxt[:, None]], 1)
            finished |= nxt == eos
            if finished.all():
                break
        return ys


def warmup_cosine(step, warmup, total):
    if step < warmup:
        return step / max(1, warmup)
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * prog))


@torch.no_grad()
def run_eval(model, loader, tok, cfg, device):
    model.eval()
    correct, total = 0, 0
    for img, ys in loader:
        img = img.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16):
            pred = model.module.generate(img, tok.bos, tok.eos, cfg.max_len)
        for p, t in zip(pred.tolist(), ys.tolist()):
            correct += int(tok.strip(p) == tok.strip(t))
            total += 1
    counts = torch.tensor([correct, total], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    model.train()
    return (counts[0] / counts[1]).item()


def main():
    cfg = load_config()
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    log.info("config: %s", asdict(cfg))

    tok = Tokenizer(os.path.join(cfg.data_root, "vocab.txt"))
    train_ds = FormulaDataset(cfg.data_root, "train", tok, cfg.img_h, cfg.max_len)
    val_ds = FormulaDataset(cfg.data_root, "val", tok, cfg.img_h, cfg.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=cfg.workers, pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=cfg.batch_size, sampler=DistributedSampler(val_ds, shuffle=False),
                        collate_fn=collate, num_workers=cfg.workers, pin_memory=True)

    model = FormulaModel(len(tok.itos), cfg.d_model, cfg.dec_layers, cfg.max_len)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.05)
    total_steps = cfg.epochs * len(train_dl)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, cfg.warmup_steps, total_steps))

    os.makedirs(cfg.out, exist_ok=True)
    best_acc, step = 0.0, 0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for img, ys in train_dl:
            img, ys = img.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = model(img, ys[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), ys[:, 1:].flatten(), ignore_index=tok.pad)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.log_every == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, loss.item(),
                         scheduler.get_last_lr()[0])

        acc = run_eval(model, val_dl, tok, cfg, device)
        log.info("epoch %d exact-match %.4f", epoch, acc)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "itos": tok.itos, "cfg": asdict(cfg),
                        "epoch": epoch, "acc": acc}, os.path.join(cfg.out, "last.pt"))
            if acc > best_acc:
                best_acc = acc
                torch.save(model.module.state_dict(), os.path.join(cfg.out, "best_model.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
