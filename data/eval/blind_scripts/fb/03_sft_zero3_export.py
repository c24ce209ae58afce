#!/usr/bin/env python
# ZeRO-3 full fine-tune for 13B-class models, exports an HF-format folder at the end.
#
#   deepspeed --num_gpus 8 sft_zero3_export.py --model_path /shared/models/llama-2-13b \
#       --data_dir /shared/data/sft_v3 --output_dir /shared/ckpt/sft13b_v3
import argparse
import glob
import json
import logging
import os
import shutil

import deepspeed
import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq
from transformers.integrations import HfDeepSpeedConfig

log = logging.getLogger(__name__)


def build_parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_path", required=True)
    ap.add_argument("--data_dir", required=True, help="pre-tokenized dataset saved with save_to_disk")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--per_device_batch_size", type=int, default=2)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=8)
    ap.add_argument("--learning_rate", type=float, default=1e-5)
    ap.add_argument("--weight_decay", type=float, default=0.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup_steps", type=int, default=100)
    ap.add_argument("--offload", action="store_true", help="offload params+optimizer to CPU")
    ap.add_argument("--save_steps", type=int, default=1000)
    ap.add_argument("--keep_last", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap


def make_ds_config(args, world_size, total_steps):
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if args.offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": args.per_device_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": args.per_device_batch_size * args.gradient_accumulation_steps * world_size,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": args.learning_rate, "betas": [0.9, 0.95], "eps": 1e-8,
                       "weight_decay": args.weight_decay},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.learning_rate,
                       "warmup_num_steps": args.warmup_steps, "total_num_steps": total_steps},
        },
        "steps_per_print": 50,
    }


def rotate_checkpoints(output_dir, keep_last):
    tags = sorted(glob.glob(os.path.join(output_dir, "step*")), key=lambda p: int(p.rsplit("step", 1)[-1]))
    for old in tags[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def main():
    args = build_parser().parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR)

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token

    dataset = load_from_disk(args.data_dir)
    train_ds = dataset["train"].with_format(columns=["input_ids", "attention_mask", "labels"])
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=17)
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    loader = DataLoader(train_ds, batch_size=args.per_device_batch_size, sampler=sampler,
                        collate_fn=collator, num_workers=4, pin_memory=True)

    total_steps = len(loader) * args.epochs // args.gradient_accumulation_steps
    ds_config = make_ds_config(args, world_size, total_steps)

    # must stay alive while the model is constructed so weights are partitioned at load time
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841
    config = AutoConfig.from_pretrained(args.model_path)
    config.use_cache = False
    model = AutoModelForCausalLM.from_pretrained(args.model_path, config=config, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_epoch = 0
    if os.path.exists(os.path.join(args.output_dir, "latest")):
        _, client_state = engine.load_checkpoint(args.output_dir, load_optimizer_states=True,
                                                 load_lr_scheduler_states=True)
        start_epoch = client_state.get("epoch", 0)
        log.info("resuming at epoch %d, global step %d", start_epoch, engine.global_steps)

    engine.train()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(engine.local_rank) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()

            if engine.is_gradient_accumulation_boundary():
                step = engine.global_steps
                if step % 10 == 0:
                    log.info("epoch=%d step=%d loss=%.4f lr=%.2e", epoch, step, loss.item(), engine.get_lr()[0])
                if step % args.save_steps == 0:
                    engine.save_checkpoint(args.output_dir, tag=f"step{step}", client_state={"epoch": epoch})
                    if rank == 0:
                        rotate_checkpoints(args.output_dir, args.keep_last)
                    dist.barrier()

    engine.save_checkpoint(args.output_dir, tag="final", client_state={"epoch": args.epochs})

    # export a plain HF folder for the eval / serving team
    export_dir = os.path.join(args.output_dir, "hf_export")
    if rank == 0:
        os.makedirs(export_dir, exist_ok=True)
        state_dict = engine.module.state_dict()
        torch.save(state_dict, os.path.join(export_dir, "pytorch_model.bin"))
        engine.module.config.save_pretrained(export_dir)
        tokenizer.save_pretrained(export_dir)
        with open(os.path.join(export_dir, "train_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        log.info("exported to %s", export_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
