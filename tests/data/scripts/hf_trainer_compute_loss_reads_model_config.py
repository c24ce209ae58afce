"""A Trainer subclass whose compute_loss weighs the classes and reads the label
count from the `model` the Trainer passes it. With more than one GPU that is
the wrapped model (DistributedDataParallel under torchrun, DataParallel in one
process), which has no `config`: AttributeError on the first step, though the
same script trains on one GPU."""

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments


class WeightedTrainer(Trainer):
    def __init__(self, *args, class_weights=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits.view(-1, model.config.num_labels)  # expect: ddp-wrapper-attribute
        loss = F.cross_entropy(logits, labels.view(-1), weight=self.class_weights.to(logits.device))
        return (loss, outputs) if return_outputs else loss


def main(train_set):
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased", num_labels=3)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=16, num_train_epochs=1)
    trainer = WeightedTrainer(model=model, args=args, train_dataset=train_set, class_weights=torch.ones(3))
    trainer.train()
