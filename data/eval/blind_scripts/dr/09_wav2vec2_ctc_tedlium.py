"""wav2vec2-large-lv60 CTC fine-tuning on TED-LIUM 3.

    torchrun --nproc_per_node=8 09_wav2vec2_ctc_tedlium.py --config conf/ted3_w2v2_large.yaml

Config keys: see TrainConfig.
"""
import argparse
import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass

import soundfile as sf
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor, get_linear_schedule_with_warmup
import editdistance

logger = logging.getLogger("ted3")


@dataclass
class TrainConfig:
    train_manifest: str = "data/ted3/train.jsonl"
    dev_manifest: str = "data/ted3/dev.jsonl"
    processor_dir: str = "data/ted3/processor"
    pretrained: str = "facebook/wav2vec2-large-lv60"
    output_dir: str = "exp/ted3_w2v2_large"
    batch_size: int = 4
    grad_accum: int = 4
    lr: float = 3e-5
    warmup_frac: float = 0.1
    epochs: int = 10
    max_seconds: float = 18.0
    mask_time_prob: float = 0.065
    workers: int = 6
    seed: int = 1


def load_config(path):
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in raw.items() if k in known})


class TedDataset(Dataset):
    def __init__(self, manifest, processor, max_seconds=None):
        with open(manifest) as f:
            rows = [json.loads(l) for l in f]
        if max_seconds:
            rows = [r for r in rows if r["duration"] <= max_seconds]
        # TED-LIUM has <unk> tokens in the references; drop them for training targets
        self.rows = rows
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio_filepath"], dtype="float32")
        text = " ".join(w for w in r["text"].split() if w != "<unk>").upper()
        x = self.processor(wav, sampling_rate=sr).input_values[0]
        y = self.processor.tokenizer(text).input_ids
        return x, y, text


class Collator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        xs, ys, texts = zip(*batch)
        enc = self.processor.feature_extractor.pad({"input_values": list(xs)}, padding=True,
                                                   return_attention_mask=True, return_tensors="pt")
        ymax = max(len(y) for y in ys)
        labels = torch.full((len(ys), ymax), -100, dtype=torch.long)
        for i, y in enumerate(ys):
            labels[i, : len(y)] = torch.tensor(y)
        enc["labels"] = labels
        return enc, list(texts)


class Trainer:
    def __init__(self, cfg, model, processor, train_loader, dev_loader, device, rank, world):
        self.cfg, self.processor = cfg, processor
        self.model, self.device, self.rank, self.world = model, device, rank, world
        self.train_loader, self.dev_loader = train_loader, dev_loader
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
        self.updates_per_epoch = len(train_loader) // cfg.grad_accum
        total = self.updates_per_epoch * cfg.epochs
        self.sched = get_linear_schedule_with_warmup(self.opt, int(cfg.warmup_frac * total), total)
        self.scaler = torch.cuda.amp.GradScaler()
        self.updates = 0

    @property
    def is_main(self):
        return self.rank == 0

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)
        running = torch.zeros(2, device=self.device)
        for i, (batch, _) in enumerate(self.train_loader):
            if i >= self.updates_per_epoch * self.cfg.grad_accum:
                break
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            last_micro = (i + 1) % self.cfg.grad_accum == 0
            ctx = self.model.no_sync() if not last_micro else _nullctx()
            with ctx:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = self.model(**batch).loss / self.cfg.grad_accum
                self.scaler.scale(loss).backward()
            running += torch.stack([loss.detach().float() * self.cfg.grad_accum, torch.ones((), device=self.device)])
            if not last_micro:
                continue
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.updates += 1
            if self.updates % 100 == 0:
                dist.all_reduce(running)
                if self.is_main:
                    logger.info("ep %d upd %d loss %.4f lr %.3e", epoch, self.updates,
                                (running[0] / running[1]).item(), self.sched.get_last_lr()[0])
                running.zero_()

    @torch.no_grad()
    def evaluate(self):
        model = self.model.module
        model.eval()
        errs, words, n_utt = 0, 0, 0
        for batch, texts in self.dev_loader:
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(input_values=batch["input_values"], attention_mask=batch["attention_mask"]).logits
            hyps = self.processor.batch_decode(logits.argmax(-1))
            for ref, hyp in zip(texts, hyps):
                errs += editdistance.eval(ref.split(), hyp.split())
                words += len(ref.split())
                n_utt += 1
        totals = torch.tensor([errs, words, n_utt], dtype=torch.long)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        model.train()
        errs, words, n_utt = totals.tolist()
        return errs / max(words, 1), n_utt

    def save(self, epoch, wer):
        if not self.is_main:
            return
        out = os.path.join(self.cfg.output_dir, f"epoch-{epoch:02d}")
        self.model.module.save_pretrained(out)
        self.processor.save_pretrained(out)
        torch.save({"opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                    "scaler": self.scaler.state_dict(), "updates": self.updates, "wer": wer},
                   os.path.join(out, "train_state.pt"))


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = load_config(ap.parse_args().config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(cfg.seed)

    processor = Wav2Vec2Processor.from_pretrained(cfg.processor_dir)
    train_ds = TedDataset(cfg.train_manifest, processor, cfg.max_seconds)
    dev_ds = TedDataset(cfg.dev_manifest, processor)
    dev_ds.rows = sorted(dev_ds.rows, key=lambda r: r["duration"])[rank::world]
    collator = Collator(processor)
    train_loader = DataLoader(train_ds, batch_size=cfg.batch_size,
                              sampler=DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True),
                              collate_fn=collator, num_workers=cfg.workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=8, collate_fn=collator, num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        cfg.pretrained, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, mask_time_prob=cfg.mask_time_prob, layerdrop=0.0,
    )
    model.freeze_feature_encoder()
    model = DDP(model.to(device), device_ids=[local_rank])

    trainer = Trainer(cfg, model, processor, train_loader, dev_loader, device, rank, world)
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        logger.info("config: %s", dataclasses.asdict(cfg))
    best = math.inf
    for epoch in range(cfg.epochs):
        trainer.train_epoch(epoch)
        wer, n = trainer.evaluate()
        if rank == 0:
            logger.info("epoch %d: dev WER %.2f%% on %d utterances", epoch, 100 * wer, n)
        trainer.save(epoch, wer)
        if rank == 0 and wer < best:
            best = wer
            with open(os.path.join(cfg.output_dir, "best_epoch.txt"), "w") as f:
                f.write(f"{epoch} {wer:.5f}\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
