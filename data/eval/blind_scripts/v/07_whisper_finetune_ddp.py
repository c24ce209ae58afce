"""Fine-tune whisper-large-v3 on in-house call-center audio (8 kHz upsampled, ~11k hours).

Features are precomputed (log-mel, 128 bins) and stored as an HF `datasets` Arrow dataset on
Lustre by prepare_callcenter.py.

Launch, Slurm 2 nodes x 8 A100-80GB:

    #SBATCH -N 2 --ntasks-per-node=1 --gres=gpu:8 --cpus-per-task=64
    head=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)
    srun torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint $head:29411 --rdzv_id $SLURM_JOB_ID \
        finetune_whisper.py --data /lustre/asr/callcenter_v3_feats \
        --output /lustre/exp/whisper-lv3-cc --epochs 3

MLflow: MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME exported in the sbatch file.
"""
import argparse
import logging
import math
import os

import evaluate
import mlflow
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import WhisperForConditionalGeneration, WhisperProcessor, get_linear_schedule_with_warmup

logger = logging.getLogger("whisper-ft")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="openai/whisper-large-v3")
    ap.add_argument("--data", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--per-device-batch", type=int, default=16)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--max-label-len", type=int, default=448)
    return ap.parse_args()


class Collator:
    def __init__(self, processor, decoder_start_id, max_label_len):
        self.processor = processor
        self.start = decoder_start_id
        self.max_label_len = max_label_len

    def __call__(self, rows):
        feats = torch.stack([torch.tensor(r["input_features"], dtype=torch.float32) for r in rows])
        labels = self.processor.tokenizer.pad(
            {"input_ids": [r["labels"][: self.max_label_len] for r in rows]}, return_tensors="pt")
        ids = labels["input_ids"].masked_fill(labels["attention_mask"].ne(1), -100)
        if (ids[:, 0] == self.start).all():
            ids = ids[:, 1:]
        return {"input_features": feats, "labels": ids}


@torch.no_grad()
def evaluate_wer(model, loader, processor, device):
    model.eval()
    preds, refs = [], []
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model.module.generate(batch["input_features"].to(device), language="en",
                                        task="transcribe", max_new_tokens=225)
        preds += processor.batch_decode(out, skip_special_tokens=True)
        lab = batch["labels"].masked_fill(batch["labels"] == -100, processor.tokenizer.pad_token_id)
        refs += processor.batch_decode(lab, skip_special_tokens=True)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"p": preds, "r": refs})
    model.train()
    if dist.get_rank() != 0:
        return None
    wer = evaluate.load("wer")
    all_p = [p for g in gathered for p in g["p"]]
    all_r = [r for g in gathered for r in g["r"]]
    norm = processor.tokenizer.normalize
    return wer.compute(predictions=[norm(p) for p in all_p], references=[norm(r) for r in all_r])


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    processor = WhisperProcessor.from_pretrained(args.model)
    model = WhisperForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32)
    model.config.forced_decoder_ids = None
    model.generation_config.forced_decoder_ids = None
    model.config.use_cache = False
    model.to(device)

    ds = load_from_disk(args.data)
    train, valid = ds["train"], ds["validation"]
    collate = Collator(processor, model.config.decoder_start_token_id, args.max_label_len)
    tr_sampler = DistributedSampler(train, shuffle=True, seed=42)
    tr_loader = DataLoader(train, batch_size=args.per_device_batch, sampler=tr_sampler, collate_fn=collate,
                           num_workers=8, pin_memory=True, drop_last=True)
    va_loader = DataLoader(Subset(valid, range(rank, len(valid), world)), batch_size=32,
                           collate_fn=collate, num_workers=4)

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    updates = math.ceil(len(tr_loader) / args.grad_accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, updates)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        mlflow.start_run(run_name=os.path.basename(args.output))
        mlflow.log_params(vars(args) | {"world_size": world})

    update = 0
    model.train()
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for i, batch in enumerate(tr_loader):
            feats = batch["input_features"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            last_micro = (i + 1) % args.grad_accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_features=feats, labels=labels).loss
            if not torch.isfinite(loss):
                logger.warning("rank %d: non-finite loss at epoch %d iter %d, skipping batch", rank, epoch, i)
                opt.zero_grad(set_to_none=True)
                continue
            if last_micro:
                (loss / args.grad_accum).backward()
            else:
                with model.no_sync():
                    (loss / args.grad_accum).backward()
                continue

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1

            if update % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metrics({"train_loss": l.item(), "lr": sched.get_last_lr()[0]}, step=update)

            if update % args.eval_every == 0:
                wer = evaluate_wer(model, va_loader, processor, device)
                if rank == 0:
                    mlflow.log_metric("eval_wer", wer, step=update)
                    logger.info("update %d  WER %.4f", update, wer)
                    model.module.save_pretrained(os.path.join(args.output, f"update-{update}"))
                    processor.save_pretrained(os.path.join(args.output, f"update-{update}"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output, "final"))
        processor.save_pretrained(os.path.join(args.output, "final"))
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
