"""LaTeX-OCR: patch ViT encoder (variable width, 2D learned positions) + Transformer decoder,
beam search on validation, BLEU / exact match over the whole validation set, early stopping.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        06_latex_ocr_vit_decoder.py --data /shared/datasets/latex_ocr --out /shared/runs/vit_tf
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchtext.data.metrics import bleu_score
import torchvision.transforms.functional as TF


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--max_h", type=int, default=192)
    p.add_argument("--max_w", type=int, default=672)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--max_seq", type=int, default=256)
    p.add_argument("--beam", type=int, default=3)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class LatexImages(Dataset):
    def __init__(self, root, split, tok, max_h, max_w, patch, max_seq):
        with open(os.path.join(root, f"{split}.txt"), encoding="utf-8") as f:
            self.rows = [l.rstrip("\n").split("\t", 1) for l in f]
        self.root, self.tok = root, tok
        self.max_h, self.max_w, self.patch, self.max_seq = max_h, max_w, patch, max_seq

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        name, latex = self.rows[i]
        im = Image.open(os.path.join(self.root, "images", name)).convert("L")
        w, h = im.size
        s = min(self.max_h / h, self.max_w / w, 1.0)
        nw, nh = max(self.patch, int(w * s)), max(self.patch, int(h * s))
        nw, nh = -(-nw // self.patch) * self.patch, -(-nh // self.patch) * self.patch
        x = TF.to_tensor(im.resize((nw, nh), Image.BICUBIC))
        x = TF.normalize(x, [0.7931], [0.1738])
        ids = self.tok.encode(latex).ids[: self.max_seq]
        return i, x, torch.tensor(ids, dtype=torch.long)


def make_collate(pad_id, fill):
    def collate(batch):
        idx, xs, ys = zip(*batch)
        H, W = max(x.shape[1] for x in xs), max(x.shape[2] for x in xs)
        img = torch.full((len(xs), 1, H, W), fill)
        for k, x in enumerate(xs):
            img[k, :, : x.shape[1], : x.shape[2]] = x
        ys = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=pad_id)
        return torch.tensor(idx), img, ys
    return collate


class ViTEncoder(nn.Module):
    def __init__(self, dim, patch, max_h, max_w, depth=6, heads=6):
        super().__init__()
        self.patch = patch
        self.grid_w = max_w // patch
        self.embed = nn.Conv2d(1, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (max_h // patch) * self.grid_w + 1, dim))
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        B, _, H, W = x.shape
        h, w = H // self.patch, W // self.patch
        t = self.embed(x).flatten(2).transpose(1, 2)
        # pick the position rows for an h x w grid out of the max grid (as in pix2tex)
        pos_idx = (torch.arange(h, device=x.device)[:, None] * self.grid_w
                   + torch.arange(w, device=x.device)[None]).flatten() + 1
        pos_idx = torch.cat([torch.zeros(1, dtype=torch.long, device=x.device), pos_idx])
        t = torch.cat([self.cls.expand(B, -1, -1), t], 1) + self.pos[:, pos_idx]
        return self.norm(self.blocks(t))


class LatexOCR(nn.Module):
    def __init__(self, vocab, a, pad_id):
        super().__init__()
        self.encoder = ViTEncoder(a.dim, a.patch, a.max_h, a.max_w)
        self.tok_emb = nn.Embedding(vocab, a.dim, padding_idx=pad_id)
        self.pos_emb = nn.Embedding(a.max_seq, a.dim)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(a.dim, 8, 4 * a.dim, 0.1, activation="gelu", batch_first=True,
                                       norm_first=True), 4)
        self.lm_head = nn.Linear(a.dim, vocab)
        self.pad_id = pad_id

    def step(self, memory, ys):
        L = ys.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=ys.device).triu(1)
        h = self.tok_emb(ys) + self.pos_emb.weight[:L]
        return self.lm_head(self.decoder(h, memory, tgt_mask=causal))

    def forward(self, img, ys):
        return self.step(self.encoder(img), ys)

    @torch.no_grad()
    def beam_search(self, img, bos, eos, beam, max_len, alpha=0.6):
        memory = self.encoder(img)                                  # 1, N, D
        seqs = torch.full((1, 1), bos, dtype=torch.long, device=img.device)
        scores = torch.zeros(1, device=img.device)
        done = []
        for t in range(max_len - 1):
            lp = self.step(memory.expand(seqs.shape[0], -1, -1), seqs)[:, -1].log_softmax(-1)
            cand = (scores[:, None] + lp).flatten()
            top, idx = cand.topk(min(beam, cand.numel()))
            src, tok = idx // lp.shape[-1], idx % lp.shape[-1]
            seqs = torch.cat([seqs[src], tok[:, None]], 1)
            scores = top
            ended = tok == eos
            for s, sc in zip(seqs[ended], scores[ended]):
                done.append((sc.item() / (((5 + s.shape[0]) / 6) ** alpha), s[1:-1].tolist()))
            seqs, scores = seqs[~ended], scores[~ended]
            if len(done) >= beam or seqs.shape[0] == 0:
                break
        if not done:
            done = [(sc.item(), s[1:].tolist()) for s, sc in zip(seqs, scores)]
        return max(done, key=lambda d: d[0])[1]


def evaluate(model, loader, tok, a, device, n_total):
    net = model.module
    net.eval()
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    pad = tok.token_to_id("[PAD]")
    local = {}
    for idx, img, ys in loader:
        for k in range(img.shape[0]):
            hyp = net.beam_search(img[k:k + 1].to(device), bos, eos, a.beam, a.max_seq)
            ref = [t for t in ys[k].tolist() if t not in (bos, eos, pad)]
            local[int(idx[k])] = (hyp, ref)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    net.train()
    merged = {}
    for p in parts:
        merged.update(p)        # DistributedSampler pads by repeating indices; the dict dedups them
    assert len(merged) == n_total
    hyps = [[tok.id_to_token(t) for t in merged[i][0]] for i in sorted(merged)]
    refs = [[[tok.id_to_token(t) for t in merged[i][1]]] for i in sorted(merged)]
    return bleu_score(hyps, refs), sum(h == r[0] for h, r in zip(hyps, refs)) / len(hyps)


def main():
    a = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = Tokenizer.from_file(a.tokenizer or os.path.join(a.data, "tokenizer.json"))
    pad_id = tok.token_to_id("[PAD]")
    train_ds = LatexImages(a.data, "train", tok, a.max_h, a.max_w, a.patch, a.max_seq)
    val_ds = LatexImages(a.data, "val", tok, a.max_h, a.max_w, a.patch, a.max_seq)
    collate = make_collate(pad_id, fill=(1.0 - 0.7931) / 0.1738)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    tr_dl = DataLoader(train_ds, a.bs, sampler=tr_sampler, collate_fn=collate, num_workers=8,
                       pin_memory=True, drop_last=True, persistent_workers=True)
    va_dl = DataLoader(val_ds, 16, sampler=DistributedSampler(val_ds, shuffle=False), collate_fn=collate,
                       num_workers=4)

    model = LatexOCR(tok.get_vocab_size(), a, pad_id).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(tr_dl) // a.accum)
    start, best, bad = 0, -1.0, 0
    ckpt_path = os.path.join(a.out, "last.pt")
    if a.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start, best, bad = ck["epoch"] + 1, ck["best"], ck["bad"]
    model = DDP(model, device_ids=[local_rank])

    for epoch in range(start, a.epochs):
        tr_sampler.set_epoch(epoch)
        for i, (_, img, ys) in enumerate(tr_dl):
            img, ys = img.to(device, non_blocking=True), ys.to(device, non_blocking=True)
            sync = (i + 1) % a.accum == 0
            ctx = model.no_sync() if not sync else torch.enable_grad()
            with ctx, torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(img, ys[:, :-1])
                loss = F.cross_entropy(logits.float().transpose(1, 2), ys[:, 1:], ignore_index=pad_id)
                (loss / a.accum).backward()
            if sync:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i}/{len(tr_dl)} loss {loss.item():.4f}", flush=True)

        bleu, em = evaluate(model, va_dl, tok, a, device, len(val_ds))
        stop = False
        if bleu > best:
            best, bad = bleu, 0
        else:
            bad += 1
            stop = bad >= a.patience
        if rank == 0:
            print(f"epoch {epoch}: BLEU {bleu:.4f} EM {em:.4f} (best {best:.4f})", flush=True)
            os.makedirs(a.out, exist_ok=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best, "bad": bad}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if bad == 0:
                torch.save(model.module.state_dict(), os.path.join(a.out, "best_model.pt"))
        dist.barrier()
        if stop:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
