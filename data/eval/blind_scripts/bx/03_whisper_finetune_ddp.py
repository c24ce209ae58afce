"""Fine-tune Whisper on a Hugging Face audio dataset with plain PyTorch DDP.

    torchrun --nproc_per_node 8 03_whisper_finetune_ddp.py --model openai/whisper-small \
        --dataset mozilla-foundation/common_voice_11_0 --language hi
"""
import argparse
import math
import os
import time

import evaluate as hf_evaluate
import torch
import torch.distributed as dist
from datasets import Audio, load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import (WhisperForConditionalGeneration, WhisperProcessor,
                          get_cosine_schedule_with_warmup)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/whisper-small")
    ap.add_argument("--dataset", default="mozilla-foundation/common_voice_11_0")
    ap.add_argument("--language", default="hi")
    ap.add_argument("--task", default="transcribe")
    ap.add_argument("--out", default="runs/whisper-small-hi")
    ap.add_argument("--batch_size", type=int, default=16, help="per GPU")
    ap.add_argument("--grad_accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--max_steps", type=int, default=5000)
    ap.add_argument("--eval_steps", type=int, default=1000)
    ap.add_argument("--max_eval_samples", type=int, default=2000)
    ap.add_argument("--num_beams", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4)
    return ap.parse_args()


class WhisperCollator:
    def __init__(self, processor, decoder_start_token_id):
        self.processor = processor
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, examples):
        feats = [{"input_features": ex["input_features"]} for ex in examples]
        batch = self.processor.feature_extractor.pad(feats, return_tensors="pt")
        labels = [{"input_ids": ex["labels"]} for ex in examples]
        lab = self.processor.tokenizer.pad(labels, return_tensors="pt")
        ids = lab["input_ids"].masked_fill(lab["attention_mask"].ne(1), -100)
        # the model prepends the start token itself when it builds decoder inputs
        if (ids[:, 0] == self.decoder_start_token_id).all():
            ids = ids[:, 1:]
        batch["labels"] = ids
        batch["text"] = [ex["sentence"] for ex in examples]
        return batch


def prepare_dataset(args, processor, split):
    ds = load_dataset(args.dataset, args.language, split=split)
    ds = ds.remove_columns([c for c in ds.column_names if c not in ("audio", "sentence")])
    ds = ds.cast_column("audio", Audio(sampling_rate=16000))

    def _prep(ex):
        a = ex["audio"]
        ex["input_features"] = processor.feature_extractor(
            a["array"], sampling_rate=a["sampling_rate"]).input_features[0]
        ex["labels"] = processor.tokenizer(ex["sentence"]).input_ids
        return ex

    return ds.map(_prep, remove_columns=["audio"], num_proc=4, desc=f"featurize {split}")


@torch.no_grad()
def run_eval(model, loader, processor, metric, device, num_beams):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        feats = batch["input_features"].to(device, dtype=torch.bfloat16)
        generated = model.generate(feats, max_new_tokens=225, num_beams=num_beams)
        preds += processor.batch_decode(generated, skip_special_tokens=True)
        refs += batch["text"]
    model.train()
    norm = processor.tokenizer._normalize
    preds = [norm(p) for p in preds]
    refs = [norm(r) for r in refs]
    # word-level edit counts so the shards can be summed exactly
    errs = metric.compute(predictions=preds, references=refs) * max(1, sum(len(r.split()) for r in refs))
    stats = torch.tensor([errs, sum(len(r.split()) for r in refs)], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    return (stats[0] / stats[1].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    processor = WhisperProcessor.from_pretrained(args.model, language=args.language, task=args.task)

    # let rank 0 populate the datasets cache first, the others then read it
    if not is_main:
        dist.barrier()
    train_ds = prepare_dataset(args, processor, "train+validation")
    test_ds = prepare_dataset(args, processor, "test")
    if is_main:
        dist.barrier()

    test_ds = test_ds.select(range(min(args.max_eval_samples, len(test_ds))))
    test_shard = Subset(test_ds, range(rank, len(test_ds), world))

    model = WhisperForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.generation_config.language = args.language
    model.generation_config.task = args.task
    model.generation_config.forced_decoder_ids = None
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    collator = WhisperCollator(processor, model.module.config.decoder_start_token_id)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=42)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              collate_fn=collator, num_workers=args.workers, pin_memory=True,
                              drop_last=True)
    test_loader = DataLoader(test_shard, batch_size=32, collate_fn=collator, num_workers=2)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.max_steps)
    wer_metric = hf_evaluate.load("wer")

    step, epoch, micro = 0, 0, 0
    best = math.inf
    t0 = time.time()
    model.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in train_loader:
            feats = batch["input_features"].to(device, dtype=torch.bfloat16, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            sync = (micro + 1) % args.grad_accum == 0
            if sync:
                loss = model(input_features=feats, labels=labels).loss / args.grad_accum
                loss.backward()
            else:
                with model.no_sync():
                    loss = model(input_features=feats, labels=labels).loss / args.grad_accum
                    loss.backward()
            micro += 1
            if not sync:
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if is_main and step % 25 == 0:
                print(f"step {step} loss {loss.item() * args.grad_accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

            if step % args.eval_steps == 0 or step == args.max_steps:
                wer = run_eval(model, test_loader, processor, wer_metric, device, args.num_beams)
                if is_main:
                    print(f"step {step} test WER {100 * wer:.2f}", flush=True)
                    if wer < best:
                        best = wer
                        model.module.save_pretrained(os.path.join(args.out, "best"))
                        processor.save_pretrained(os.path.join(args.out, "best"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
