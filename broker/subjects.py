"""Every name on the wire: subjects, KV keys, streams, consumers, buckets, services.

Nothing else writes a subject string or a KV key (tests/unit/test_names.py checks
it). All names hang off a :class:`Names` whose ``namespace`` (default ``jnx``)
prefixes them, so several deployments (or tests) share one server without
seeing each other. With the default namespace an operator sees::

    nats stream ls        -> JNX_JOBS, JNX_TQ, JNX_METRICS, JNX_ADVISORIES
    nats kv ls            -> JNX_TENANTS, JNX_WORKLOADS, JNX_POLICY, JNX_HEALTH,
                             JNX_TRAINER, JNX_USAGE, JNX_IDENTITIES (with authorization on)
    nats object ls        -> JNX_WEIGHTS, JNX_CHECKPOINTS
    nats micro ls         -> jnx-sched, jnx-control, jnx-infer, jnx-init

The server's own subjects (JetStream, KV, object store and micro-service APIs,
inboxes) are in broker/natsapi.py. See docs/ARCHITECTURE.md, "Layout and import
root" and "Names an operator sees".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from joynexus.broker.natsapi import JS_API
from joynexus.schemas.errors import InvalidSpec
from joynexus.schemas.jobs import JobState, check_name

_NS = re.compile(r"^[a-z][a-z0-9]{0,15}$")

# Subject tokens after the namespace.
JOB = "job"
TQ = "tq"
SCHED = "sched"
METRICS = "metrics"
INFER = "infer"
#: The agents' inference subjects (on a tenant's behalf: rollouts, evaluations);
#: only the service may publish there, so only there may a reply go to its inboxes.
SVC_INFER = "isvc"
API = "api"
ADMIN = "admin"
TQ_DATA = "d"
TQ_INDEX = "idx"
TQ_CONSUMED = "c"
HEALTH_KIND = "health"
LEASE = "lease"
#: A workload's end in the job event log: ``<ns>.job.<tenant>.~<workload>.ended``.
#: No job id starts with "~" and no job state is "ended", so no job's subject,
#: filter or state consumer ever matches one.
WORKLOAD_MARK = "~"
WORKLOAD_ENDED = "ended"

# KV key prefixes: the health bucket's heartbeats and supervisor states, the
# workloads bucket's producer cursors, the tenants bucket's policy versions.
HEARTBEAT_KEYS = "hb."
ALL_HEARTBEATS = f"{HEARTBEAT_KEYS}>"
SUPERVISOR_KEYS = "mgr."
LEASE_KEYS = "lease."
#: An environment worker's assignment (agents/envworkers/assign.py).
ASSIGNMENT_KEYS = "env."
CURSOR_KEYS = "cursor."
VERSION_KEYS = "version."
#: The API keys bucket (agents/gateway/): ``key.<id>`` the record (the operator's admin
#: API writes it), ``used.<id>`` when the gateway last accepted it.
APIKEY_KEYS = "key."
APIKEY_USED_KEYS = "used."
#: The tenants bucket's global admission limits.
GLOBAL_LIMITS_KEY = "_global.limits"
#: The trainer bucket's training-client keys (call results, named checkpoints) and
#: the named checkpoints' objects (apart from those the actor's commits sweep).
CALL_RESULT_KEYS = "res."
NAMED_STATE_KEYS = "state."
CLIENT_EPOCH_KEYS = "client."
NAMED_STATE_OBJECTS = "states"

def any_namespace(token: str, tail: str = ">") -> str:
    """``*.<token>.<tail>``: a subject of this layout in every namespace."""
    return f"*.{token}.{tail}"


SCHEDULER_VERBS = (
    "reserve",
    "mark",
    "lease_stage",
    "lease_next",
    "touch",
    "complete",
    "drop",
    "fail",
    "set_policy",
    "set_limits",
    "set_version",
    "wait_for_ready",
    "get_job",
    "list_jobs",
    "snapshot",
)


@dataclass(frozen=True)
class Names:
    namespace: str = "jnx"

    def __post_init__(self) -> None:
        if not _NS.match(self.namespace):
            raise InvalidSpec(
                f"namespace {self.namespace!r} must be 1-16 lowercase letters/digits, "
                "starting with a letter"
            )

    # -- streams, buckets, services (upper-case for streams and buckets, as NATS shows them)
    def _upper(self, what: str) -> str:
        return f"{self.namespace.upper()}_{what}"

    @property
    def jobs_stream(self) -> str:
        return self._upper("JOBS")

    @property
    def tq_stream(self) -> str:
        return self._upper("TQ")

    @property
    def metrics_stream(self) -> str:
        return self._upper("METRICS")

    @property
    def advisories_stream(self) -> str:
        return self._upper("ADVISORIES")

    @property
    def tenants_bucket(self) -> str:
        return self._upper("TENANTS")

    @property
    def policy_bucket(self) -> str:
        return self._upper("POLICY")

    @property
    def health_bucket(self) -> str:
        return self._upper("HEALTH")

    @property
    def weights_store(self) -> str:
        return self._upper("WEIGHTS")

    @property
    def trainer_bucket(self) -> str:
        """KV of trainer checkpoint records (the commit point of an actor's state)."""
        return self._upper("TRAINER")

    @property
    def checkpoints_store(self) -> str:
        """Object store of trainer checkpoints (module, optimizer, applied jobs)."""
        return self._upper("CHECKPOINTS")

    @property
    def scheduler_service(self) -> str:
        return f"{self.namespace}-sched"

    @property
    def control_service(self) -> str:
        return f"{self.namespace}-control"

    @property
    def workloads_bucket(self) -> str:
        return self._upper("WORKLOADS")

    @property
    def usage_bucket(self) -> str:
        """KV of the usage meter's checkpoint (broker/usage.py)."""
        return self._upper("USAGE")

    # -- the tenant API (what the SDK publishes); the tenant is the 3rd token
    def api(self, tenant_id: str, verb: str) -> str:
        return f"{self.namespace}.{API}.{tenant_id}.{verb}"

    @property
    def all_api(self) -> str:
        return f"{self.namespace}.{API}.*.*"

    # -- the operator API (tenant slots and their credentials); only the admin identity
    def admin(self, verb: str) -> str:
        return f"{self.namespace}.{ADMIN}.{verb}"

    @property
    def all_admin(self) -> str:
        return f"{self.namespace}.{ADMIN}.*"

    # -- identities on the server (authorization on)
    @property
    def identities_bucket(self) -> str:
        return self._upper("IDENTITIES")

    @property
    def apikeys_bucket(self) -> str:
        """KV of the policy gateway's API keys (sha256 hashes only; agents/gateway/)."""
        return self._upper("APIKEYS")

    def tenant_user(self, tenant_id: str) -> str:
        """The NATS user of a tenant: ``<ns>.<tenant>`` (the server's log names it)."""
        return f"{self.namespace}.{tenant_id}"

    @property
    def service_user(self) -> str:
        return f"{self.namespace}-service"

    @property
    def admin_user(self) -> str:
        return f"{self.namespace}-admin"

    @property
    def control_user(self) -> str:
        """The control plane: the service's rights plus writing tenant identities."""
        return f"{self.namespace}-control"

    @property
    def responder_user(self) -> str:
        """The connection the request servers (control plane, inference engines)
        answer on: it may publish only to inboxes."""
        return f"{self.namespace}-responder"

    @property
    def service_inbox_prefix(self) -> str:
        """Inbox prefix of the agents' connections (``_svc`` is no tenant name)."""
        return f"_INBOX.{self.namespace}._svc"

    @property
    def admin_inbox_prefix(self) -> str:
        """Inbox prefix of operator connections: no identity but admin may read it."""
        return f"_INBOX.{self.namespace}._admin"

    def inbox_prefix(self, tenant_id: str) -> str:
        """Where a tenant's replies arrive (``_INBOX.<ns>.<tenant>.>``): it may
        subscribe there and nowhere else."""
        return f"_INBOX.{self.namespace}.{tenant_id}"

    @staticmethod
    def workload_key(tenant_id: str, name: str) -> str:
        return f"{tenant_id}.{name}"

    @staticmethod
    def cursor_key(tenant_id: str, name: str) -> str:
        """Key in the workloads bucket of an SFT producer's dataset cursor."""
        return f"{CURSOR_KEYS}{tenant_id}.{name}"

    @staticmethod
    def version_key(tenant_id: str, workload: str) -> str:
        """Key in the tenants bucket of a policy's current version (``set_version``)."""
        return f"{VERSION_KEYS}{tenant_id}.{workload}"

    @property
    def inference_service(self) -> str:
        return f"{self.namespace}-infer"

    # -- the Inference Queue (request-reply) and policy publication
    def infer(self, base_model: str, tenant_id: str = "*") -> str:
        """Inference subject of one base model and tenant, e.g.
        ``jnx.infer.qwen2_5-vl-tiny.acme``; the engines serve ``tenant_id="*"``.
        The tenant is a subject token so the broker can fence it: a tenant may
        publish only to its own, and the engine checks the payload against it."""
        return f"{self.namespace}.{INFER}.{model_token(base_model)}.{tenant_id}"

    def service_infer(self, base_model: str, tenant_id: str = "*") -> str:
        """The agents' inference subject for ``tenant_id``'s policy (rollouts and
        evaluations the service runs for it): ``jnx.isvc.<model>.<tenant>``. Only
        the service publishes here, so only a request here may be answered in the
        agents' inboxes; a request on the tenant's own subject is answered only in
        the tenant's."""
        return f"{self.namespace}.{SVC_INFER}.{model_token(base_model)}.{tenant_id}"

    def tenant_infer(self, tenant_id: str) -> str:
        """Every base model's inference subject of one tenant (what it may publish to)."""
        return f"{self.namespace}.{INFER}.*.{tenant_id}"

    @staticmethod
    def policy_record_key(tenant_id: str, workload: str) -> str:
        """Key in the policy bucket: ``<tenant>.<workload>``."""
        return f"{tenant_id}.{workload}"

    @staticmethod
    def weights_object(tenant_id: str, workload: str, version: int) -> str:
        """Object name in the weights store for one policy version."""
        return f"{tenant_id}/{workload}/v{version}.safetensors"

    @staticmethod
    def call_result_key(tenant_id: str, workload: str, job_id: str) -> str:
        """Key in the trainer bucket of a training-client call's result."""
        return f"{CALL_RESULT_KEYS}{tenant_id}.{workload}.{job_id}"

    @staticmethod
    def client_epoch_key(tenant_id: str, workload: str) -> str:
        """Key in the trainer bucket of a custom workload's current training client."""
        return f"{CLIENT_EPOCH_KEYS}{tenant_id}.{workload}"

    @staticmethod
    def named_state_key(tenant_id: str, workload: str, name: str) -> str:
        """Key in the trainer bucket of a named checkpoint (``*``: a filter of all)."""
        return f"{NAMED_STATE_KEYS}{tenant_id}.{workload}.{name}"

    @staticmethod
    def named_state_object(tenant_id: str, workload: str, name: str, nonce: str) -> str:
        """Object name in the checkpoints store of a named checkpoint's bytes."""
        return f"{NAMED_STATE_OBJECTS}/{tenant_id}/{workload}/{name}-{nonce}.ckpt"

    # -- the job event log
    def job_subject(self, tenant_id: str, job_id: str, state: JobState | str) -> str:
        return f"{self.namespace}.{JOB}.{tenant_id}.{job_id}.{JobState(state).value}"

    def job_filter(self, tenant_id: str, job_id: str) -> str:
        """Every event of one job: the compare-and-append scope."""
        return f"{self.namespace}.{JOB}.{tenant_id}.{job_id}.*"

    def jobs_in_state(self, state: JobState | str, tenant_id: str = "*") -> str:
        return f"{self.namespace}.{JOB}.{tenant_id}.*.{JobState(state).value}"

    def tenant_jobs(self, tenant_id: str) -> str:
        """Every event of every job of one tenant (what a tenant may read)."""
        return f"{self.namespace}.{JOB}.{tenant_id}.*.*"

    @property
    def all_jobs(self) -> str:
        return f"{self.namespace}.{JOB}.>"

    def workload_end_subject(self, tenant_id: str, workload: str) -> str:
        """Where a workload's end (``WorkloadEnded``) is appended: in each tenant's
        job events (``tenant_jobs``) and so in what ``read_events`` pages."""
        return f"{self.namespace}.{JOB}.{tenant_id}.{WORKLOAD_MARK}{workload}.{WORKLOAD_ENDED}"

    @property
    def all_workload_ends(self) -> str:
        return f"{self.namespace}.{JOB}.*.*.{WORKLOAD_ENDED}"

    # -- single-instance roles held by a lease (agents/leases.py)
    @staticmethod
    def lease_key(role: str) -> str:
        """Key in the health bucket of the lease on a single-instance role."""
        return f"{LEASE_KEYS}{role}"

    def lease_epoch(self, role: str) -> str:
        """Subject (in the jobs stream) of the epoch a new holder writes on taking over;
        its sequence fences the previous holder's admission appends."""
        return f"{self.namespace}.{LEASE}.{role}"

    @property
    def all_lease_epochs(self) -> str:
        return f"{self.namespace}.{LEASE}.>"

    def stage_consumer(self, stage: str) -> str:
        """Durable consumer of the stage workers (e.g. ``advantages``)."""
        return f"stage-{stage.replace('_', '-')}"

    # -- the Training Queue
    def tq_partition(self, tenant_id: str, partition_id: str) -> str:
        return f"{self.namespace}.{TQ}.{tenant_id}.{partition_id}.>"

    def tq_data(self, tenant_id: str, partition_id: str, field: str) -> str:
        return f"{self.namespace}.{TQ}.{tenant_id}.{partition_id}.{TQ_DATA}.{field}"

    def tq_index(self, tenant_id: str, partition_id: str) -> str:
        return f"{self.namespace}.{TQ}.{tenant_id}.{partition_id}.{TQ_INDEX}"

    def tq_consumed(self, tenant_id: str, partition_id: str, task_name: str) -> str:
        return f"{self.namespace}.{TQ}.{tenant_id}.{partition_id}.{TQ_CONSUMED}.{task_name}"

    @staticmethod
    def direct_get(stream: str, api_prefix: str = JS_API) -> str:
        """JetStream's direct-get API subject for ``stream`` (batched reads)."""
        return f"{api_prefix}.DIRECT.GET.{stream}"

    @property
    def all_tq(self) -> str:
        return f"{self.namespace}.{TQ}.>"

    @property
    def all_tq_indexes(self) -> str:
        """The index records of every Training Queue partition."""
        return f"{self.namespace}.{TQ}.*.*.{TQ_INDEX}"

    # -- the scheduler API
    def sched(self, verb: str) -> str:
        if verb not in SCHEDULER_VERBS:
            raise InvalidSpec(f"unknown scheduler verb {verb!r}")
        return f"{self.namespace}.{SCHED}.{verb}"

    # -- the actor's policy initialisation (agents only: under the scheduler's token,
    # which only the service identities may publish on)
    @property
    def policy_init_service(self) -> str:
        """The actor role's micro service that publishes version 1 of a new workload's
        policy (fresh weights: torch), for the control plane (which imports none)."""
        return f"{self.namespace}-init"

    @property
    def policy_init(self) -> str:
        """Its endpoint: ``<ns>.sched.init_policy``."""
        return f"{self.namespace}.{SCHED}.init_policy"

    # -- metrics and advisories
    def metrics(self, kind: str, tenant_id: str = "_") -> str:
        return f"{self.namespace}.{METRICS}.{kind}.{tenant_id}"

    @property
    def all_metrics(self) -> str:
        return f"{self.namespace}.{METRICS}.>"

    @property
    def max_deliveries_advisories(self) -> str:
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.jobs_stream}.>"

    # -- health: heartbeats and supervisor state in KV <NS>_HEALTH, decisions as metrics
    @staticmethod
    def heartbeat_key(role: str, instance: str) -> str:
        """Key of one agent's heartbeat (per-message TTL): ``hb.<role>.<instance>``."""
        return f"{HEARTBEAT_KEYS}{role}.{instance}"

    @staticmethod
    def heartbeats(role: str = "*") -> str:
        """KV filter of every heartbeat (of one ``role``): ``hb.>`` / ``hb.<role>.>``."""
        return ALL_HEARTBEATS if role == "*" else f"{HEARTBEAT_KEYS}{role}.>"

    @staticmethod
    def supervisor_key(instance: str) -> str:
        """Key of a health manager's state (its slots and recent decisions)."""
        return f"{SUPERVISOR_KEYS}{instance}"

    @property
    def health_events(self) -> str:
        """Health decisions (restart, give up, ...): metric kind ``health``."""
        return self.metrics(HEALTH_KIND)


def model_token(base_model: str) -> str:
    """A base model id as one subject token (dots separate tokens in NATS)."""
    token = base_model.replace(".", "_")
    if not token or any(c in token for c in " *>\t"):
        raise InvalidSpec(f"base model id {base_model!r} cannot be used in a subject")
    return token


def is_workload_end(subject: str) -> bool:
    """Whether a job-log subject carries a workload's end, not a job's event."""
    parts = subject.split(".")
    return len(parts) == 5 and parts[1] == JOB and parts[3].startswith(WORKLOAD_MARK)


def parse_job_subject(subject: str) -> tuple[str, str, str]:
    """``<ns>.job.<tenant>.<job>.<state>`` -> (tenant, job, state)."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[1] != JOB:
        raise InvalidSpec(f"{subject!r} is not a job event subject")
    return parts[2], parts[3], parts[4]


def check_token(kind: str, value: str) -> str:
    """A value that becomes one subject token."""
    return check_name(kind, value)
