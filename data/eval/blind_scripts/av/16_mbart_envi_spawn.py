"""mBART-50 fine-tuning for IWSLT'15 En->Vi, one node, workers started with torch.multiprocessing.

    python 16_mbart_envi_spawn.py --data data/iwslt15_en_vi --out ckpt/mbart50_envi --gpus 8
"""
import argparse
import math
import os
import random
import time

import sacrebleu
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MBart50TokenizerFast, MBartForConditionalGeneration, get_polynomial_decay_schedule_with_warmup


def build_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="facebook/mbart-large-50")
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--max_tokens", type=int, default=2048)
    p.add_argument("--update_freq", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--warmup", type=int, default=2500)
    p.add_argument("--total_updates", type=int, default=40000)
    p.add_argument("--label_smoothing", type=float, default=0.2)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--valid_interval", type=int, default=2000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--seed", type=int, default=222)
    return p


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [l.strip() for l in f]


def tokenize_split(tok, data, split, max_len=256):
    src, tgt = read_lines(f"{data}/{split}.en"), read_lines(f"{data}/{split}.vi")
    enc = tok(src, text_target=tgt, max_length=max_len, truncation=True)
    return list(zip(enc["input_ids"], enc["labels"])), tgt


def token_batches(pairs, max_tokens, seed):
    rng = random.Random(seed)
    # add noise to lengths so batches differ a little between epochs
    keyed = sorted(range(len(pairs)), key=lambda i: (max(len(pairs[i][0]), len(pairs[i][1])) + rng.random()))
    batches, cur, w = [], [], 0
    for i in keyed:
        n = max(len(pairs[i][0]), len(pairs[i][1]))
        if cur and max(w, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, w = [], 0
        cur.append(i)
        w = max(w, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def to_device(pairs, idx, pad, device):
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][0]) for i in idx], batch_first=True, padding_value=pad)
    lab = torch.nn.utils.rnn.pad_sequence([torch.tensor(pairs[i][1]) for i in idx], batch_first=True, padding_value=-100)
    return ids.to(device), ids.ne(pad).to(device), lab.to(device)


@torch.no_grad()
def bleu_on_valid(model, tok, pairs, refs, cfg, device, rank, world_size):
    model.eval()
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))[rank::world_size]
    out = []
    for s in range(0, len(order), 32):
        idx = order[s:s + 32]
        ids, attn, _ = to_device(pairs, idx, tok.pad_token_id, device)
        gen = model.generate(input_ids=ids, attention_mask=attn, num_beams=cfg.beam, max_new_tokens=200,
                             forced_bos_token_id=tok.convert_tokens_to_ids("vi_VN"))
        out += list(zip(idx, tok.batch_decode(gen, skip_special_tokens=True)))
    parts = [None] * world_size
    dist.all_gather_object(parts, out)
    model.train()
    hyp = dict(x for p in parts for x in p)
    return sacrebleu.corpus_bleu([hyp[i] for i in range(len(refs))], [refs]).score


def train_worker(rank, world_size, cfg):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(cfg.seed)

    tok = MBart50TokenizerFast.from_pretrained(cfg.model, src_lang="en_XX", tgt_lang="vi_VN")
    train_pairs, _ = tokenize_split(tok, cfg.data, "train")
    valid_pairs, valid_refs = tokenize_split(tok, cfg.data, "tst2012")

    model = MBartForConditionalGeneration.from_pretrained(cfg.model, dropout=cfg.dropout).to(device)
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), eps=1e-6)
    sched = get_polynomial_decay_schedule_with_warmup(opt, cfg.warmup, cfg.total_updates)
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=cfg.label_smoothing)
    scaler = torch.cuda.amp.GradScaler()

    num_updates, best, epoch = 0, 0.0, 0
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
    t0 = time.time()
    while num_updates < cfg.total_updates:
        epoch += 1
        batches = token_batches(train_pairs, cfg.max_tokens, seed=cfg.seed + epoch)
        chunk = world_size * cfg.update_freq
        batches = batches[: len(batches) // chunk * chunk]
        mine = batches[rank::world_size]
        model.train()
        for k, idx in enumerate(mine):
            ids, attn, labels = to_device(train_pairs, idx, tok.pad_token_id, device)
            boundary = (k + 1) % cfg.update_freq == 0
            if boundary:
                with torch.autocast("cuda", dtype=torch.float16):
                    logits = model(input_ids=ids, attention_mask=attn, labels=labels).logits
                loss = ce(logits.float().view(-1, logits.size(-1)), labels.view(-1))
                scaler.scale(loss / cfg.update_freq).backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.float16):
                        logits = model(input_ids=ids, attention_mask=attn, labels=labels).logits
                    loss = ce(logits.float().view(-1, logits.size(-1)), labels.view(-1))
                    scaler.scale(loss / cfg.update_freq).backward()
                continue

            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            sched.step()
            num_updates += 1

            if num_updates % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} upd {num_updates} loss {l.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                          f"scale {scaler.get_scale():.0f} {time.time() - t0:.0f}s", flush=True)
            if num_updates % cfg.valid_interval == 0:
                bleu = bleu_on_valid(model.module, tok, valid_pairs, valid_refs, cfg, device, rank, world_size)
                if rank == 0:
                    print(f"| valid @ {num_updates}: BLEU {bleu:.2f} (best {max(best, bleu):.2f})", flush=True)
                    if bleu > best:
                        best = bleu
                        model.module.save_pretrained(os.path.join(cfg.out, "best"))
                        tok.save_pretrained(os.path.join(cfg.out, "best"))
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "scaler": scaler.state_dict(),
                                "num_updates": num_updates}, os.path.join(cfg.out, "checkpoint_last.pt"))
                dist.barrier()
            if num_updates >= cfg.total_updates:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    cfg = build_parser().parse_args()
    world_size = cfg.gpus
    mp.spawn(train_worker, args=(cfg, world_size), nprocs=world_size, join=True)
