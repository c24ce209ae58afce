"""Train a Marian-style transformer from scratch on WMT14 En-De with token batches, then average
the last N epoch checkpoints and score newstest2014 with beam search.

torchrun --nproc_per_node=8 11_marian_scratch_ckpt_avg.py --data data/wmt14_en_de --tokenizer Helsinki-NLP/opus-mt-en-de
"""
import argparse
import collections
import contextlib
import glob
import math
import os
import random
import re

import sacrebleu
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MarianConfig, MarianMTModel, MarianTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokenizer", default="Helsinki-NLP/opus-mt-en-de")
    ap.add_argument("--save_dir", default="checkpoints/marian_scratch_ende")
    ap.add_argument("--max_tokens", type=int, default=5120)
    ap.add_argument("--update_freq", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--label_smoothing", type=float, default=0.1)
    ap.add_argument("--avg_last", type=int, default=5)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2)
    return ap.parse_args()


def read(path):
    with open(path, encoding="utf-8") as f:
        return [l.rstrip("\n") for l in f]


def encode_pairs(tok, src, tgt):
    s = tok(src, truncation=True, max_length=256)["input_ids"]
    t = tok(text_target=tgt, truncation=True, max_length=256)["input_ids"]
    return list(zip(s, t))


def bucket(pairs, max_tokens):
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches, cur, w = [], [], 0
    for i in order:
        n = max(len(pairs[i][0]), len(pairs[i][1]))
        if cur and max(w, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, w = [], 0
        cur.append(i)
        w = max(w, n)
    if cur:
        batches.append(cur)
    return batches


def pad_batch(pairs, idx, pad, device):
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][0]) for i in idx], batch_first=True, padding_value=pad)
    lab = torch.nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][1]) for i in idx], batch_first=True, padding_value=-100)
    return src.to(device), src.ne(pad).to(device), lab.to(device)


def average_checkpoints(paths):
    avg = collections.OrderedDict()
    for p in paths:
        sd = torch.load(p, map_location="cpu")["model"]
        for k, v in sd.items():
            v = v.float()
            avg[k] = avg[k] + v if k in avg else v.clone()
    for k in avg:
        avg[k].div_(len(paths))
    return avg


def epoch_ckpts(save_dir):
    paths = glob.glob(os.path.join(save_dir, "checkpoint*.pt"))
    paths = [p for p in paths if re.search(r"checkpoint(\d+)\.pt$", p)]
    return sorted(paths, key=lambda p: int(re.search(r"checkpoint(\d+)\.pt$", p).group(1)))


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = MarianTokenizer.from_pretrained(args.tokenizer)
    train = encode_pairs(tok, read(f"{args.data}/train.en"), read(f"{args.data}/train.de"))
    batches = bucket(train, args.max_tokens)

    config = MarianConfig(
        vocab_size=tok.vocab_size, d_model=512, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
        dropout=0.1, attention_dropout=0.1, activation_function="relu", max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
        scale_embedding=True, share_encoder_decoder_embeddings=True,
    )
    model = MarianMTModel(config).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    scaler = torch.cuda.amp.GradScaler()
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=args.label_smoothing, reduction="sum")

    start_epoch = 1
    existing = epoch_ckpts(args.save_dir) if os.path.isdir(args.save_dir) else []
    if existing:
        ckpt = torch.load(existing[-1], map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs + 1):
        model.train()
        order = list(batches)
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        n = len(order) // (world * args.update_freq) * (world * args.update_freq)
        mine = order[:n][rank::world]
        tot = torch.zeros(2, device=device)
        for i, idx in enumerate(mine):
            src, attn, labels = pad_batch(train, idx, tok.pad_token_id, device)
            last_micro = (i + 1) % args.update_freq == 0
            with (model.no_sync() if not last_micro else contextlib.nullcontext()):
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(input_ids=src, attention_mask=attn, labels=labels).logits
                ntok = labels.ne(-100).sum()
                loss = ce(logits.float().view(-1, logits.size(-1)), labels.view(-1))
                scaler.scale(loss / ntok / args.update_freq).backward()
            tot += torch.stack([loss.detach(), ntok.float()])
            if last_micro:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
        dist.all_reduce(tot)
        if rank == 0:
            print(f"| epoch {epoch:03d} | loss/tok {(tot[0] / tot[1]).item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}",
                  flush=True)
            torch.save({
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "epoch": epoch,
            }, os.path.join(args.save_dir, f"checkpoint{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()

    # ---- final: average the last N epoch checkpoints and translate newstest2014 (rank 0 only) ----
    if rank != 0:
        return
    paths = epoch_ckpts(args.save_dir)[-args.avg_last:]
    print("| averaging:", ", ".join(os.path.basename(p) for p in paths))
    averaged = average_checkpoints(paths)
    final = MarianMTModel(config)
    final.load_state_dict(averaged)
    final.save_pretrained(os.path.join(args.save_dir, "averaged"))
    tok.save_pretrained(os.path.join(args.save_dir, "averaged"))
    final.to(device).eval().half()

    src_test = read(f"{args.data}/newstest2014.en")
    ref_test = read(f"{args.data}/newstest2014.de")
    hyps = []
    with torch.no_grad():
        for s in range(0, len(src_test), 64):
            enc = tok(src_test[s:s + 64], return_tensors="pt", padding=True, truncation=True, max_length=256).to(device)
            out = final.generate(**enc, num_beams=args.beam, max_new_tokens=256, length_penalty=0.6)
            hyps.extend(tok.batch_decode(out, skip_special_tokens=True))
    bleu = sacrebleu.corpus_bleu(hyps, [ref_test])
    print(f"| newstest2014 averaged-{len(paths)} {bleu}")
    with open(os.path.join(args.save_dir, "newstest2014.hyp.de"), "w") as f:
        f.write("\n".join(hyps) + "\n")


if __name__ == "__main__":
    main()
