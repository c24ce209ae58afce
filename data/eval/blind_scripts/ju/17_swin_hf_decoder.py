"""Train a Swin (HF) + Transformer decoder report generator, then decode the test split
with the best checkpoint and write predictions for offline RadGraph / CheXbert scoring.

    torchrun --nproc_per_node=8 17_swin_hf_decoder.py --root /data/mimic_rrg --out exp/swin_dec
"""
import argparse
import json
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoImageProcessor, AutoTokenizer, SwinModel, get_cosine_schedule_with_warmup


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/mimic_rrg")
    p.add_argument("--out", default="exp/swin_dec")
    p.add_argument("--swin", default="microsoft/swin-base-patch4-window7-224-in22k")
    p.add_argument("--tokenizer", default="StanfordAIMI/RadBERT")
    p.add_argument("--bs", type=int, default=24)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-len", type=int, default=128)
    return p.parse_args()


class RRGSplit(Dataset):
    def __init__(self, root, split, processor, tok, max_len):
        self.df = pd.read_csv(os.path.join(root, f"{split}.csv"))
        self.root, self.proc, self.tok, self.max_len = root, processor, tok, max_len

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, "images", r.image)).convert("RGB")
        px = self.proc(images=img, return_tensors="pt").pixel_values[0]
        t = self.tok(r.findings, max_length=self.max_len, truncation=True, padding="max_length",
                     return_tensors="pt")
        return px, t.input_ids[0], t.attention_mask[0], i


class SwinReportDecoder(nn.Module):
    def __init__(self, swin_name, vocab, pad_id, max_len, d=768, layers=4):
        super().__init__()
        self.swin = SwinModel.from_pretrained(swin_name)
        self.mem_proj = nn.Linear(self.swin.config.hidden_size * 2 ** (len(self.swin.config.depths) - 1), d)
        self.emb = nn.Embedding(vocab, d, padding_idx=pad_id)
        self.pos = nn.Embedding(max_len, d)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(d, 12, 3072, 0.1, activation="gelu", batch_first=True, norm_first=True),
            layers, norm=nn.LayerNorm(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.pad_id = pad_id

    def memory(self, px):
        return self.mem_proj(self.swin(pixel_values=px).last_hidden_state)

    def logits(self, ids, mem):
        L = ids.size(1)
        x = self.emb(ids) + self.pos.weight[:L]
        causal = nn.Transformer.generate_square_subsequent_mask(L, device=ids.device)
        return self.lm_head(self.decoder(x, mem, tgt_mask=causal, tgt_key_padding_mask=ids == self.pad_id))

    def forward(self, px, ids):
        return self.logits(ids, self.memory(px))

    @torch.no_grad()
    def greedy(self, px, bos, eos, max_len):
        mem = self.memory(px)
        ids = torch.full((px.size(0), 1), bos, dtype=torch.long, device=px.device)
        for _ in range(max_len - 1):
            nxt = self.logits(ids, mem)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if (ids == eos).any(1).all():
                break
        return ids


def sharded_loader(ds, bs, shuffle):
    sampler = DistributedSampler(ds, shuffle=shuffle, drop_last=shuffle)
    return DataLoader(ds, batch_size=bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=shuffle), sampler


def decode_split(net, loader, tok, device, max_len, world):
    net.eval()
    local = []
    for px, _, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net.greedy(px.to(device), tok.cls_token_id, tok.sep_token_id, max_len)
        local += zip(idx.tolist(), tok.batch_decode(out, skip_special_tokens=True))
    parts = [None] * world
    dist.all_gather_object(parts, local)
    return dict(p for part in parts for p in part)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    proc = AutoImageProcessor.from_pretrained(args.swin)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    train_ds = RRGSplit(args.root, "train", proc, tok, args.max_len)
    val_ds = RRGSplit(args.root, "val", proc, tok, args.max_len)
    test_ds = RRGSplit(args.root, "test", proc, tok, args.max_len)
    train_dl, train_sampler = sharded_loader(train_ds, args.bs, True)
    val_dl, _ = sharded_loader(val_ds, args.bs, False)
    test_dl, _ = sharded_loader(test_ds, args.bs, False)

    model = SwinReportDecoder(args.swin, len(tok), tok.pad_token_id, args.max_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = get_cosine_schedule_with_warmup(opt, len(train_dl), args.epochs * len(train_dl))
    best_path = os.path.join(args.out, "best.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    best_loss = float("inf")
    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for step, (px, ids, am, _) in enumerate(train_dl):
            px, ids = px.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(px, ids[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), ignore_index=tok.pad_token_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"[train] epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for px, ids, am, _ in val_dl:
                px, ids = px.to(device), ids.to(device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(px, ids[:, :-1])
                tot[0] += F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(),
                                          ignore_index=tok.pad_token_id, reduction="sum")
                tot[1] += (ids[:, 1:] != tok.pad_token_id).sum()
        dist.all_reduce(tot)
        val_loss = (tot[0] / tot[1]).item()
        if rank == 0:
            print(f"[val] epoch {epoch} loss {val_loss:.4f}", flush=True)
            if val_loss < best_loss:
                best_loss = val_loss
                torch.save({"model": model.state_dict(), "epoch": epoch, "val_loss": val_loss}, best_path)
        dist.barrier()

    # ---- test: fresh model from the best checkpoint ----
    test_model = SwinReportDecoder(args.swin, len(tok), tok.pad_token_id, args.max_len)
    ckpt = torch.load(best_path, map_location="cpu")
    test_model.load_state_dict(ckpt["model"])
    test_model.to(device)
    preds = decode_split(test_model, test_dl, tok, device, args.max_len, world)
    if rank == 0:
        rows = [{"study_id": str(test_ds.df.study_id.iloc[i]), "reference": test_ds.df.findings.iloc[i],
                 "generated": preds[i]} for i in sorted(preds)]
        with open(os.path.join(args.out, "test_predictions.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {len(rows)} test predictions (best epoch {ckpt['epoch']})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
