"""LoRA instruction tuning of Idefics2-8B on DocVQA with DeepSpeed ZeRO-2 (Python API).

The vision encoder stays frozen; LoRA adapters go on the Mistral decoder and the connector
is trained fully.

    deepspeed --num_gpus 4 14_idefics2_lora_deepspeed.py --train /data/docvqa/train_v1.0.json \
        --images /data/docvqa/images --out ckpt/idefics2_docvqa_lora
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, Idefics2ForConditionalGeneration

DS_CONFIG = {
    "train_batch_size": 128,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 50, "total_num_steps": 2000},
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="HuggingFaceM4/idefics2-8b")
    p.add_argument("--train", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=500)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class DocVQA(Dataset):
    def __init__(self, path, image_dir):
        self.rows = json.load(open(path))["data"]
        self.image_dir = image_dir

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return os.path.join(self.image_dir, os.path.basename(r["image"])), r["question"], r["answers"][0]


class Collator:
    def __init__(self, processor):
        self.processor = processor
        self.image_token_id = processor.tokenizer.additional_special_tokens_ids[
            processor.tokenizer.additional_special_tokens.index("<image>")]

    def __call__(self, batch):
        texts, images = [], []
        for path, q, a in batch:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]},
                    {"role": "assistant", "content": [{"type": "text", "text": a}]}]
            texts.append(self.processor.apply_chat_template(msgs, add_generation_prompt=False).strip())
            images.append([Image.open(path).convert("RGB")])
        enc = self.processor(text=texts, images=images, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        labels[labels == self.image_token_id] = -100
        enc["labels"] = labels
        return enc


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)

    processor = AutoProcessor.from_pretrained(args.model, do_image_splitting=False)
    model = Idefics2ForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                             _attn_implementation="flash_attention_2")
    model.model.vision_model.requires_grad_(False)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_r, lora_dropout=0.1, init_lora_weights="gaussian",
                      target_modules=r".*(text_model).*(down_proj|gate_proj|up_proj|k_proj|q_proj|v_proj|o_proj).*",
                      modules_to_save=["connector"], use_dora=False)
    model = get_peft_model(model, lora)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if rank == 0:
        model.print_trainable_parameters()

    ds = DocVQA(args.train, args.images)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    loader = DataLoader(ds, batch_size=DS_CONFIG["train_micro_batch_size_per_gpu"], sampler=sampler,
                        collate_fn=Collator(processor), num_workers=4, drop_last=True)
    sched_cfg = DS_CONFIG["scheduler"]["params"]
    sched_cfg["total_num_steps"] = args.epochs * len(loader) // DS_CONFIG["gradient_accumulation_steps"]
    sched_cfg["warmup_num_steps"] = max(1, int(0.03 * sched_cfg["total_num_steps"]))

    engine, _, _, _ = deepspeed.initialize(args=args, model=model, config=DS_CONFIG,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    device = engine.device

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            if engine.is_gradient_accumulation_boundary():
                gstep = engine.global_steps
                if gstep % 10 == 0:
                    l = loss.detach().float()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} step {gstep} loss {l.item():.4f} lr {engine.get_lr()[0]:.2e}",
                              flush=True)
                if gstep % args.save_steps == 0:
                    engine.save_checkpoint(args.out, tag=f"global_step{gstep}")

    engine.save_checkpoint(args.out, tag="final")
    if rank == 0:
        engine.module.save_pretrained(os.path.join(args.out, "adapter"))
        processor.save_pretrained(os.path.join(args.out, "adapter"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
