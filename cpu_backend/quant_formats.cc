#include "cpu_backend/quant_formats.h"

namespace pij {

bool IsQType(int32_t id) {
  switch (id) {
    case 2: case 3: case 6: case 7: case 8: case 10: case 11: case 12: case 13: case 14:
      return true;
    default:
      return false;
  }
}

const char* ArrangementName(Arrangement a) {
  switch (a) {
    case Arrangement::kRows: return "rows";
    case Arrangement::kInterleaved: return "interleaved by 16";
    case Arrangement::kColumns: return "columns";
    case Arrangement::kDownGroups: return "down groups";
  }
  return "?";
}

QTypeInfo GetQTypeInfo(QType t) {
  return VisitQType(t, []<class F>(F) {
    static constexpr const char* kNames[] = {"", "", "Q4_0", "Q4_1", "", "", "Q5_0", "Q5_1", "Q8_0",
                                             "", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"};
    return QTypeInfo{kNames[static_cast<int>(F::kType)], F::kBlock, F::kBytes};
  });
}

}  // namespace pij
