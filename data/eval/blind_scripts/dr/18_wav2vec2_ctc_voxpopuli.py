"""wav2vec2 CTC fine-tuning on VoxPopuli (en), tracked in Weights & Biases.

    torchrun --nproc_per_node=8 18_wav2vec2_ctc_voxpopuli.py --data /data/voxpopuli_en \
        --processor /data/voxpopuli_en/processor --output exp/w2v2_vp_en --run-name w2v2-base-vp-en
"""
import argparse
import json
import math
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers import Wav2Vec2ForCTC, Wav2Vec2Processor, get_linear_schedule_with_warmup
import editdistance


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--processor", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--wandb-project", default="asr-voxpopuli")
    ap.add_argument("--init", default="facebook/wav2vec2-base-10k-voxpopuli")
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max-updates", type=int, default=40000)
    ap.add_argument("--eval-interval", type=int, default=2000)
    ap.add_argument("--max-sec", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=5)
    return ap.parse_args()


def load_split(data, name, max_sec=None):
    rows = []
    with open(os.path.join(data, f"{name}.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if max_sec is None or r["duration"] <= max_sec:
                rows.append(r)
    return rows


class VPDataset(Dataset):
    def __init__(self, rows, processor):
        self.rows, self.processor = rows, processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = sf.read(r["audio_filepath"], dtype="float32")
        x = self.processor(wav, sampling_rate=sr).input_values[0]
        y = self.processor.tokenizer(r["text"]).input_ids
        return x, y, r["text"]


def collate_factory(processor):
    def collate(batch):
        xs, ys, refs = zip(*batch)
        enc = processor.feature_extractor.pad({"input_values": list(xs)}, return_attention_mask=True,
                                              return_tensors="pt")
        lab = processor.tokenizer.pad({"input_ids": list(ys)}, return_tensors="pt")
        enc["labels"] = lab["input_ids"].masked_fill(lab["attention_mask"].ne(1), -100)
        return dict(enc), list(refs)
    return collate


class LengthGroupedDistSampler(Sampler):
    """Shuffle, split into mega-batches, sort each by length, then deal batches to ranks."""

    def __init__(self, lengths, batch_size, rank, world, mega=50, seed=0):
        self.lengths, self.bs, self.rank, self.world = lengths, batch_size, rank, world
        self.mega, self.seed, self.epoch = mega, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _all_batches(self):
        rng = random.Random(self.seed + self.epoch)
        idx = list(range(len(self.lengths)))
        rng.shuffle(idx)
        m = self.bs * self.mega
        batches = []
        for s in range(0, len(idx), m):
            chunk = sorted(idx[s:s + m], key=lambda i: -self.lengths[i])
            batches += [chunk[j:j + self.bs] for j in range(0, len(chunk) - self.bs + 1, self.bs)]
        rng.shuffle(batches)
        keep = len(batches) - len(batches) % self.world
        return batches[:keep]

    def __iter__(self):
        return iter(self._all_batches()[self.rank::self.world])

    def __len__(self):
        return len(self._all_batches()) // self.world


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    s = torch.zeros(3, dtype=torch.float64, device=device)
    examples = []
    for batch, refs in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        hyps = processor.batch_decode(out.logits.argmax(-1))
        s[2] += out.loss.double() * len(refs)
        for ref, hyp in zip(refs, hyps):
            s[0] += editdistance.eval(ref.split(), hyp.split())
            s[1] += len(ref.split())
            if len(examples) < 5:
                examples.append((ref, hyp))
    n = torch.tensor(float(len(loader.dataset)), dtype=torch.float64, device=device)
    dist.all_reduce(s)
    dist.all_reduce(n)
    model.train()
    return {"wer": (s[0] / s[1]).item(), "loss": (s[2] / n).item()}, examples


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    run = wandb.init(project=args.wandb_project, name=args.run_name,
                     config={**vars(args), "world_size": world})

    processor = Wav2Vec2Processor.from_pretrained(args.processor)
    train_rows = load_split(args.data, "train", args.max_sec)
    dev_rows = sorted(load_split(args.data, "dev"), key=lambda r: r["duration"])
    collate = collate_factory(processor)
    sampler = LengthGroupedDistSampler([r["duration"] for r in train_rows], args.batch_size, rank, world,
                                       seed=args.seed)
    train_dl = DataLoader(VPDataset(train_rows, processor), batch_sampler=sampler, collate_fn=collate,
                          num_workers=6, pin_memory=True)
    dev_dl = DataLoader(VPDataset(dev_rows[rank::world], processor), batch_size=16, collate_fn=collate,
                        num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.init, vocab_size=len(processor.tokenizer), pad_token_id=processor.tokenizer.pad_token_id,
        ctc_loss_reduction="mean", ctc_zero_infinity=True, mask_time_prob=0.05, layerdrop=0.0,
    )
    model.freeze_feature_encoder()
    model = DDP(model.to(device), device_ids=[local_rank])
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                              betas=(0.9, 0.98), weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(optim, args.warmup, args.max_updates)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        processor.save_pretrained(args.output)

    update, epoch, best = 0, 0, math.inf
    t0 = time.time()
    while update < args.max_updates:
        sampler.set_epoch(epoch)
        model.train()
        for batch, _ in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            update += 1

            if update % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": gn.item(),
                           "train/lr": sched.get_last_lr()[0], "train/sec_per_update": (time.time() - t0) / 50,
                           "epoch": epoch}, step=update)
                t0 = time.time()

            if update % args.eval_interval == 0 or update == args.max_updates:
                metrics, examples = evaluate(model.module, dev_dl, processor, device)
                wandb.log({f"dev/{k}": v for k, v in metrics.items()}, step=update)
                if rank == 0:
                    print(f"update {update}: dev WER {100 * metrics['wer']:.2f}", flush=True)
                    wandb.log({"dev/examples": wandb.Table(columns=["ref", "hyp"], data=examples)}, step=update)
                    model.module.save_pretrained(os.path.join(args.output, "last"))
                    if metrics["wer"] < best:
                        best = metrics["wer"]
                        model.module.save_pretrained(os.path.join(args.output, "best"))
                        run.summary["best_dev_wer"] = best
                dist.barrier()
            if update >= args.max_updates:
                break
        epoch += 1

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
