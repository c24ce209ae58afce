#!/usr/bin/env python
# XLS-R / wav2vec2 CTC fine-tuning on Common Voice (one language).
#
# Data was prepared offline with prepare_cv.py (resampled to 16 kHz, text normalised,
# vocab.json written) and saved with Dataset.save_to_disk().
#
#   torchrun --nproc_per_node=4 04_wav2vec2_ctc_commonvoice.py \
#       --data_dir /data/cv16_de_prepared --output_dir exp/xlsr300m_de --model facebook/wav2vec2-xls-r-300m
import argparse
import logging
import math
import os

import jiwer
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    Wav2Vec2CTCTokenizer,
    Wav2Vec2FeatureExtractor,
    Wav2Vec2ForCTC,
    Wav2Vec2Processor,
    get_linear_schedule_with_warmup,
)
from transformers.trainer_pt_utils import DistributedLengthGroupedSampler

log = logging.getLogger(__name__)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model", default="facebook/wav2vec2-xls-r-300m")
    parser.add_argument("--per_device_batch_size", type=int, default=16)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--num_epochs", type=int, default=30)
    parser.add_argument("--eval_every_epochs", type=int, default=1)
    parser.add_argument("--mask_time_prob", type=float, default=0.05)
    parser.add_argument("--max_input_seconds", type=float, default=15.0)
    parser.add_argument("--num_workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=42)
    return parser


class DataCollatorCTCWithPadding:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, features):
        input_features = [{"input_values": f["input_values"]} for f in features]
        label_features = [{"input_ids": f["labels"]} for f in features]
        batch = self.processor.pad(input_features, padding=True, return_tensors="pt")
        labels_batch = self.processor.pad(labels=label_features, padding=True, return_tensors="pt")
        batch["labels"] = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        return batch


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, processor, device):
    model.eval()
    predictions, references, losses = [], [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs = model(**batch)
        losses.append(outputs.loss.item())
        pred_ids = torch.argmax(outputs.logits, dim=-1)
        predictions.extend(processor.batch_decode(pred_ids))
        label_ids = batch["labels"].masked_fill(batch["labels"] == -100, processor.tokenizer.pad_token_id)
        references.extend(processor.batch_decode(label_ids, group_tokens=False))
    wer = jiwer.wer(references, predictions)
    cer = jiwer.cer(references, predictions)
    model.train()
    return {"wer": wer, "cer": cer, "loss": float(np.mean(losses))}


def main():
    args = get_parser().parse_args()
    local_rank, rank, world_size = setup_distributed()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(args.seed)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)

    tokenizer = Wav2Vec2CTCTokenizer(os.path.join(args.data_dir, "vocab.json"),
                                     unk_token="[UNK]", pad_token="[PAD]", word_delimiter_token="|")
    feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                                 do_normalize=True, return_attention_mask=True)
    processor = Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer)

    ds = load_from_disk(args.data_dir)
    max_len = int(args.max_input_seconds * 16000)
    train_ds = ds["train"].filter(lambda n: n < max_len, input_columns=["input_length"], keep_in_memory=True)
    train_lengths = train_ds["input_length"]
    eval_ds = ds["validation"]
    train_ds = train_ds.with_format("numpy", columns=["input_values", "labels"], output_all_columns=False)
    eval_ds = eval_ds.with_format("numpy", columns=["input_values", "labels"], output_all_columns=False)
    log.info("train %d / eval %d utterances", len(train_ds), len(eval_ds))

    collator = DataCollatorCTCWithPadding(processor)
    train_sampler = DistributedLengthGroupedSampler(
        batch_size=args.per_device_batch_size, dataset=train_ds, num_replicas=world_size, rank=rank,
        seed=args.seed, drop_last=True, lengths=train_lengths,
    )
    train_loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=args.num_workers, pin_memory=True, drop_last=True)
    eval_shard = eval_ds.select(range(rank, len(eval_ds), world_size))
    eval_loader = DataLoader(eval_shard, batch_size=args.per_device_batch_size * 2, shuffle=False,
                             collate_fn=collator, num_workers=2)

    model = Wav2Vec2ForCTC.from_pretrained(
        args.model,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        feat_proj_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=args.mask_time_prob,
        ctc_loss_reduction="mean",
        ctc_zero_infinity=True,
        pad_token_id=processor.tokenizer.pad_token_id,
        vocab_size=len(processor.tokenizer),
    )
    model.freeze_feature_encoder()
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    updates_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    total_updates = updates_per_epoch * args.num_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_updates), total_updates)

    writer = None
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        processor.save_pretrained(args.output_dir)
        writer = SummaryWriter(os.path.join(args.output_dir, "runs"))

    best_wer = math.inf
    update = 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            sync_now = (i + 1) % args.grad_accum == 0 or (i + 1) == len(train_loader)
            if sync_now:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / args.grad_accum
                loss.backward()
            else:
                with model.no_sync():
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = model(**batch).loss / args.grad_accum
                    loss.backward()
            if not sync_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if writer is not None and update % 25 == 0:
                writer.add_scalar("train/loss", loss.item() * args.grad_accum, update)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], update)

        if (epoch + 1) % args.eval_every_epochs != 0:
            continue
        metrics = evaluate(model.module, eval_loader, processor, device)
        if rank == 0:
            log.info("epoch %d: eval loss %.4f WER %.4f CER %.4f", epoch, metrics["loss"], metrics["wer"],
                     metrics["cer"])
            for k, v in metrics.items():
                writer.add_scalar(f"eval/{k}", v, update)
            model.module.save_pretrained(os.path.join(args.output_dir, "last"))
            if metrics["wer"] < best_wer:
                best_wer = metrics["wer"]
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                log.info("saved new best model (WER %.4f)", best_wer)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
