"""
Text -> speech-token LM (CosyVoice-ish stage 1). Qwen2-0.5B backbone, vocab extended with
4096 codec tokens + specials. Speech tokens are precomputed (tokenize_speech.py -> *.npy).

torchrun --nproc_per_node 8 15_tts_speech_token_lm.py --manifest data/train_manifest.jsonl \
    --run_name qwen05b-s3tok-v2
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

N_SPEECH = 4096
SPECIALS = ["<|sos|>", "<|eos_speech|>", "<|task_tts|>"]
IGNORE = -100


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backbone", default="Qwen/Qwen2-0.5B")
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--val_manifest", default=None)
    ap.add_argument("--out", default="exp/tts_lm")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--max_frames", type=int, default=1500)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--steps", type=int, default=200000)
    ap.add_argument("--warmup", type=int, default=2500)
    ap.add_argument("--log_every", type=int, default=50)
    ap.add_argument("--save_every", type=int, default=5000)
    return ap.parse_args()


class SpeechTokenSet(Dataset):
    def __init__(self, manifest, tok, speech_offset, max_frames):
        self.rows = [json.loads(l) for l in open(manifest, encoding="utf-8")]
        self.rows = [r for r in self.rows if r["n_frames"] <= max_frames]
        self.tok = tok
        self.off = speech_offset
        self.sos = tok.convert_tokens_to_ids("<|sos|>")
        self.eos = tok.convert_tokens_to_ids("<|eos_speech|>")
        self.task = tok.convert_tokens_to_ids("<|task_tts|>")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        text_ids = self.tok(r["text"], add_special_tokens=False).input_ids
        speech = np.load(r["speech_tokens"]).astype(np.int64) + self.off
        ids = [self.task] + text_ids + [self.sos] + speech.tolist() + [self.eos]
        labels = [IGNORE] * (len(text_ids) + 2) + speech.tolist() + [self.eos]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    ids = torch.nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
    lab = torch.nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=IGNORE)
    att = torch.zeros_like(ids, dtype=torch.bool)
    for k, b in enumerate(batch):
        att[k, : len(b[0])] = True
    return ids, lab, att


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


def token_acc(logits, labels):
    pred = logits[:, :-1].argmax(-1)
    tgt = labels[:, 1:]
    m = tgt != IGNORE
    return (pred[m] == tgt[m]).float().mean()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for ids, lab, att in loader:
        ids, lab, att = ids.to(device), lab.to(device), att.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=att, labels=lab)
        n = (lab[:, 1:] != IGNORE).sum()
        stats += torch.stack([out.loss.float() * n, token_acc(out.logits, lab) * n, n.float()])
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)
    random.seed(1337 + rank)

    tok = AutoTokenizer.from_pretrained(args.backbone)
    speech_offset = len(tok)
    tok.add_tokens([f"<|s_{i}|>" for i in range(N_SPEECH)])
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    model = AutoModelForCausalLM.from_pretrained(args.backbone, torch_dtype=torch.float32)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=128)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    train_ds = SpeechTokenSet(args.manifest, tok, speech_offset, args.max_frames)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=1337)
    dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True,
                    drop_last=True, collate_fn=PadCollate(tok.pad_token_id))
    val_dl = None
    if args.val_manifest:
        val_ds = SpeechTokenSet(args.val_manifest, tok, speech_offset, args.max_frames)
        val_shard = Subset(val_ds, list(range(rank, len(val_ds), world)))  # no padding/duplicates
        val_dl = DataLoader(val_shard, batch_size=args.bs, shuffle=False,
                            collate_fn=PadCollate(tok.pad_token_id), num_workers=2)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="tts-lm", name=args.run_name, config=vars(args))

    step, epoch = 0, 0
    model.train()
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids, lab, att in dl:
            ids, lab, att = ids.to(device), lab.to(device), att.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, attention_mask=att, labels=lab)
            loss = out.loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % args.log_every == 0:
                acc = token_acc(out.logits.detach(), lab)
                wandb.log({"train/loss": loss.item(), "train/acc": acc.item(), "train/grad_norm": gnorm.item(),
                           "train/lr": sched.get_last_lr()[0],
                           "perf/sec_per_step": (time.time() - t0) / args.log_every}, step=step)
                t0 = time.time()

            if step % args.save_every == 0:
                if val_dl is not None:
                    vloss, vacc = validate(model.module, val_dl, device)
                    if rank == 0:
                        wandb.log({"val/loss": vloss, "val/acc": vacc}, step=step)
                        print(f"step {step} val loss {vloss:.4f} acc {vacc:.4f}", flush=True)
                if rank == 0:
                    d = os.path.join(args.out, f"step_{step}")
                    model.module.save_pretrained(d, safe_serialization=True)
                    tok.save_pretrained(d)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
