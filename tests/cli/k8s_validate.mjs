// Validates `pagedoptim k8s` output (YAML on stdin) for the k8s test:
// Secret, Service and Job against the Kubernetes API's JSON schemas as the
// kubernetes-models package ships them (generated from Kubernetes' OpenAPI
// spec); the gang objects (the 1.35 alpha Workload, Volcano's PodGroup),
// which that package has no schema for, by the fields the test expects.
// Prints one line per document: "<kind> <name> ok" or "<kind> invalid: why";
// exits 1 if any is invalid.
import { parseAllDocuments } from "yaml";
import { Secret, Service } from "kubernetes-models/v1";
import { Job } from "kubernetes-models/batch/v1";

const text = await new Promise((resolve) => {
  let s = "";
  process.stdin.on("data", (d) => (s += d));
  process.stdin.on("end", () => resolve(s));
});
const models = { "v1/Secret": Secret, "v1/Service": Service, "batch/v1/Job": Job };
let bad = 0;
for (const doc of parseAllDocuments(text)) {
  if (doc.errors.length) {
    console.log(`yaml invalid: ${doc.errors[0].message}`);
    bad++;
    continue;
  }
  const o = doc.toJS();
  const key = `${o.apiVersion}/${o.kind}`;
  try {
    if (models[key]) {
      // The pod-template field of the 1.35 alpha (workloadRef) is newer than these schemas: checked apart.
      const copy = structuredClone(o);
      const ref = copy.spec?.template?.spec?.workloadRef;
      if (ref) delete copy.spec.template.spec.workloadRef;
      new models[key](copy).validate();
      if (ref && (typeof ref.name !== "string" || typeof ref.podGroup !== "string"))
        throw new Error("workloadRef needs name and podGroup strings");
    } else if (key === "scheduling.k8s.io/v1alpha2/Workload") {
      const g = o.spec?.podGroupTemplates?.[0];
      if (!g?.name || !(g.schedulingPolicy?.gang?.minCount > 0)) throw new Error("a podGroupTemplate with a gang minCount");
    } else if (key === "scheduling.volcano.sh/v1beta1/PodGroup") {
      if (!(o.spec?.minMember > 0)) throw new Error("spec.minMember");
    } else {
      throw new Error(`unexpected object ${key}`);
    }
    console.log(`${o.kind} ${o.metadata.name} ok`);
  } catch (e) {
    console.log(`${o.kind} invalid: ${e.message.split("\n")[0]}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
