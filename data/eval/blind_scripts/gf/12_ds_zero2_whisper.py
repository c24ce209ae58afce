"""
Fine-tune whisper-large-v3 on a custom ASR corpus with DeepSpeed ZeRO-2 and the optimizer
offloaded to CPU (DeepSpeedCPUAdam). Encoder/decoder gradient checkpointing is on.

    deepspeed --num_gpus 4 12_ds_zero2_whisper.py --train_manifest data/train.tsv \
        --dev_manifest data/dev.tsv --output_dir exp/whisper-lv3-ft
"""
import argparse
import csv
import os
import time

import deepspeed
import evaluate as hf_evaluate
import soundfile as sf
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from transformers import WhisperForConditionalGeneration, WhisperProcessor


class ManifestDataset(Dataset):
    """TSV with columns: path<TAB>duration<TAB>transcript"""

    def __init__(self, manifest, processor, max_seconds=30.0):
        self.items = []
        with open(manifest) as f:
            for row in csv.reader(f, delimiter="\t"):
                if float(row[1]) <= max_seconds:
                    self.items.append((row[0], row[2]))
        self.processor = processor

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        audio, sr = sf.read(path, dtype="float32")
        feats = self.processor.feature_extractor(audio, sampling_rate=sr, return_tensors="pt").input_features[0]
        labels = self.processor.tokenizer(text).input_ids
        return {"input_features": feats, "labels": torch.tensor(labels)}


def collate(batch, pad_id=-100):
    feats = torch.stack([b["input_features"] for b in batch])
    labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True, padding_value=pad_id)
    return {"input_features": feats, "labels": labels}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="openai/whisper-large-v3")
    p.add_argument("--train_manifest", required=True)
    p.add_argument("--dev_manifest", required=True)
    p.add_argument("--output_dir", default="exp/whisper-ft")
    p.add_argument("--language", default="german")
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--grad_accum", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def ds_config(args, world, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_bs * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.98]}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": args.warmup, "total_num_steps": total_steps}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
        "steps_per_print": 100,
    }


@torch.no_grad()
def compute_wer(engine, loader, processor, rank, world):
    engine.eval()
    model = engine.module
    preds, refs = [], []
    for batch in loader:
        feats = batch["input_features"].to(engine.device, dtype=torch.half)
        out = model.generate(input_features=feats, max_new_tokens=225)
        preds += processor.batch_decode(out, skip_special_tokens=True)
        lab = batch["labels"].masked_fill(batch["labels"] == -100, processor.tokenizer.pad_token_id)
        refs += processor.batch_decode(lab, skip_special_tokens=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, (preds, refs))
    engine.train()
    if rank != 0:
        return None
    all_p = [p for g in gathered for p in g[0]]
    all_r = [r for g in gathered for r in g[1]]
    return 100 * hf_evaluate.load("wer").compute(predictions=all_p, references=all_r)


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    torch.manual_seed(3)

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task="transcribe")
    model = WhisperForConditionalGeneration.from_pretrained(args.model)
    model.config.forced_decoder_ids = None
    model.generation_config.language = args.language
    model.generation_config.task = "transcribe"
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    train_ds = ManifestDataset(args.train_manifest, processor)
    dev_ds = ManifestDataset(args.dev_manifest, processor)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=3)
    train_loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=train_sampler, collate_fn=collate,
                              num_workers=8, pin_memory=True, drop_last=True)
    # strided, unpadded split of the dev set so no utterance is scored twice
    dev_shard = Subset(dev_ds, list(range(rank, len(dev_ds), world)))
    dev_loader = DataLoader(dev_shard, batch_size=16, shuffle=False, collate_fn=collate, num_workers=4)

    total_steps = args.epochs * len(train_loader) // args.grad_accum
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(args, world, total_steps),
    )

    best_wer = float("inf")
    for epoch in range(args.epochs):
        engine.train()
        t0 = time.time()
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            batch["input_features"] = batch["input_features"].half()
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0):.0f}s", flush=True)

        wer = compute_wer(engine, dev_loader, processor, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev WER {wer:.2f}", flush=True)
        is_best = torch.tensor([1 if (rank == 0 and wer < best_wer) else 0], device=engine.device)
        dist.broadcast(is_best, src=0)
        engine.save_checkpoint(os.path.join(args.output_dir, "ckpt"), tag=f"epoch{epoch}")
        if is_best.item():
            if rank == 0:
                best_wer = wer
                engine.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
