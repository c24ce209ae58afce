"""Step-based CTC fine-tuning of wav2vec2-conformer (rel-pos, large) on a character vocabulary.

Config is read from a JSON file; command-line flags override it.

    torchrun --nproc_per_node=8 16_w2v2_conformer_ctc_steps.py --config conf/w2v2conf_ls960.json
"""
import argparse
import itertools
import json
import os
import time

import editdistance
import torch
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2ConformerForCTC, Wav2Vec2CTCTokenizer

DEFAULT_CFG = {
    "pretrained": "facebook/wav2vec2-conformer-rel-pos-large",
    "tokenizer": "facebook/wav2vec2-base-960h",
    "train_tsv": "data/ls960/train.tsv",
    "dev_tsv": "data/ls960/dev_other.tsv",
    "out_dir": "exp/w2v2conf_ls960",
    "batch_size": 6,
    "max_seconds": 16.0,
    "lr": 3e-5,
    "warmup_steps": 8000,
    "total_steps": 320000,
    "eval_steps": 5000,
    "log_steps": 100,
    "workers": 6,
}


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    for k, v in DEFAULT_CFG.items():
        ap.add_argument(f"--{k}", type=type(v), default=None)
    ns = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if ns.config:
        with open(ns.config) as f:
            cfg.update(json.load(f))
    cfg.update({k: v for k, v in vars(ns).items() if v is not None and k != "config"})
    return cfg


class TsvSpeech(Dataset):
    def __init__(self, tsv, tokenizer, max_seconds=None):
        self.rows = []
        with open(tsv) as f:
            for line in f:
                path, n, text = line.rstrip("\n").split("\t")
                if max_seconds is None or int(n) <= max_seconds * 16000:
                    self.rows.append((path, text))
        self.tok = tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, text = self.rows[i]
        wav, _ = torchaudio.load(path)
        wav = wav[0]
        wav = (wav - wav.mean()) / torch.sqrt(wav.var() + 1e-7)
        return wav, self.tok(text.upper()).input_ids, text.upper()


def make_collate(pad_id):
    def _collate(batch):
        wavs, ids, texts = zip(*batch)
        n = torch.tensor([w.numel() for w in wavs])
        x = torch.zeros(len(wavs), int(n.max()))
        att = torch.zeros(len(wavs), int(n.max()), dtype=torch.long)
        for i, w in enumerate(wavs):
            x[i, : w.numel()] = w
            att[i, : w.numel()] = 1
        L = max(len(t) for t in ids)
        y = torch.full((len(ids), L), -100, dtype=torch.long)
        for i, t in enumerate(ids):
            y[i, : len(t)] = torch.tensor(t)
        return x, att, y, list(texts)
    return _collate


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch


@torch.no_grad()
def evaluate(model, loader, tokenizer, device):
    model.eval()
    errs = torch.zeros(2, dtype=torch.long, device=device)
    for x, att, _, texts in loader:
        logits = model(x.to(device), attention_mask=att.to(device)).logits
        hyps = tokenizer.batch_decode(logits.argmax(-1))
        for h, r in zip(hyps, texts):
            errs[0] += editdistance.eval(h.split(), r.split())
            errs[1] += len(r.split())
    dist.all_reduce(errs)
    model.train()
    return errs[0].item() / max(1, errs[1].item())


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = Wav2Vec2CTCTokenizer.from_pretrained(cfg["tokenizer"])
    collate = make_collate(tokenizer.pad_token_id)
    train_ds = TsvSpeech(cfg["train_tsv"], tokenizer, cfg["max_seconds"])
    dev_ds = TsvSpeech(cfg["dev_tsv"], tokenizer)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=8,
                        collate_fn=collate, num_workers=2)

    model = Wav2Vec2ConformerForCTC.from_pretrained(
        cfg["pretrained"], vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, layerdrop=0.0,
        mask_time_prob=0.065, mask_time_length=10, mask_feature_prob=0.012, mask_feature_length=64,
    )
    model.freeze_feature_encoder()
    model = DDP(model.to(device), device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    W, T = cfg["warmup_steps"], cfg["total_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / W if s < W else max(0.0, (T - s) / (T - W)))

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
        with open(os.path.join(cfg["out_dir"], "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)

    best = float("inf")
    t0 = time.time()
    model.train()
    for step, (epoch, (x, att, y, _)) in enumerate(infinite(train_dl, sampler), start=1):
        x, att, y = x.to(device, non_blocking=True), att.to(device, non_blocking=True), y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, attention_mask=att, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()

        if rank == 0 and step % cfg["log_steps"] == 0:
            print(f"step {step} epoch {epoch} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.3e} "
                  f"{(time.time() - t0) / cfg['log_steps']:.2f}s/step", flush=True)
            t0 = time.time()

        if step % cfg["eval_steps"] == 0:
            if rank == 0:
                wer = evaluate(model.module, dev_dl, tokenizer, device)
                print(f"step {step}: dev-other WER {100 * wer:.2f}", flush=True)
                ckpt_dir = os.path.join(cfg["out_dir"], f"step{step}")
                model.module.save_pretrained(ckpt_dir)
                torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "step": step},
                           os.path.join(ckpt_dir, "trainer_state.pt"))
                if wer < best:
                    best = wer
                    model.module.save_pretrained(os.path.join(cfg["out_dir"], "best"))
            dist.barrier()

        if step >= T:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
